// The page of all streams: a tile each, and a form to add a stream.

import { tryApi, wireErrorBox } from "./dom.js";
import { connect } from "./live.js";
import { Tile } from "./tile.js";

const grid = document.getElementById("tiles");
const empty = document.getElementById("empty");
const status = document.getElementById("status");
const tiles = new Map();

const removeStream = async (id) => {
  const tile = tiles.get(id);
  tile?.el.classList.add("removing");
  if (!(await tryApi("DELETE", `/api/streams/${encodeURIComponent(id)}`))) tile?.el.classList.remove("removing");
  // on success the tile goes with the next state message, which no longer lists the stream
};

// Each stream at the size its tile shows it: small tiles get small frames.
const rewatch = () => live.watch(Object.fromEntries([...tiles].map(([id, tile]) => [id, tile.wanted()])));

const live = connect({
  onStatus: (s) => { status.textContent = s; status.className = s === "live" ? "ok" : "bad"; },
  onFrame: (head, jpeg) => tiles.get(head.stream)?.frame(head, jpeg),
  onState(msg) {
    const ids = Object.keys(msg.streams).sort();
    for (const [id, tile] of tiles) {
      if (!msg.streams[id]) { tile.close(); tiles.delete(id); }
    }
    for (const id of ids) {
      if (!tiles.has(id)) {
        const tile = new Tile(id, { onRemove: removeStream, onResize: rewatch });
        tiles.set(id, tile);
        // keep the grid in id order whatever order streams were added in
        const next = ids.slice(ids.indexOf(id) + 1).find((other) => tiles.get(other)?.el.isConnected);
        grid.insertBefore(tile.el, next ? tiles.get(next).el : null);
      }
      tiles.get(id).state(msg.streams[id], msg);
    }
    empty.hidden = ids.length > 0;
    rewatch();
  },
});

const form = document.getElementById("add-stream");
form.addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const data = Object.fromEntries(new FormData(form));
  const button = form.querySelector("button");
  button.disabled = true;
  if (await tryApi("POST", "/api/streams", { id: data.id.trim(), url: data.url.trim(), mode: data.mode })) form.reset();
  button.disabled = false;
});

wireErrorBox();
