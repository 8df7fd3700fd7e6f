# Sourced by the install-*-deps.sh scripts: `apt_install NAME PKG...` installs Debian packages as root
# or with passwordless sudo, and says what to install by hand when it cannot.
apt_install() {
  local who="$1"; shift
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
      sudo=(sudo -n)
    else
      echo "$who: need root (or passwordless sudo) to install:" >&2
      echo "  apt-get install $*" >&2
      return 1
    fi
  fi
  if ! { "${sudo[@]}" apt-get update -qq &&
         "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq --no-install-recommends "$@"; }; then
    echo "$who: apt-get failed; please install: $*" >&2
    return 1
  fi
}
