// The live view's WebSocket (protocol in engine/view/server.py): the page says which streams it
// shows and at what size ({"watch": {id: longer side in device pixels, or null}}: the server encodes
// each stream at the largest size its pages ask for, at most view.max_side, so a small tile costs
// the browser fewer pixels to decode); the server sends the state once a second as text, and each
// watched stream's shown frame as binary: a 4-byte big-endian length n, n bytes of JSON (the
// frame's header, with the results of that same frame), then the JPEG.

/**
 * Connect, and reconnect with a capped backoff (the engine may restart; the page stays open).
 * Returns {watch(sizes)}: call it with {id: size} (or a list of ids: no size asked) whenever the shown
 * streams or their sizes may have changed; it sends only a change.
 */
export function connect({ onState, onFrame, onStatus }) {
  let ws = null;
  let watching = {};
  let delay = 500;
  const send = () => {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ watch: watching }));
  };
  const open = () => {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    ws = new WebSocket(`${scheme}//${location.host}/ws`);  // the token cookie goes with it
    ws.binaryType = "arraybuffer";
    ws.onopen = () => { delay = 500; onStatus("live"); send(); };
    ws.onmessage = (ev) => {
      if (typeof ev.data !== "string") {
        onFrame(...parseFrame(ev.data));
        return;
      }
      const msg = JSON.parse(ev.data);
      if (msg.type === "state") onState(msg);
    };
    ws.onclose = () => {
      onStatus("disconnected: retrying");
      setTimeout(open, delay);
      delay = Math.min(delay * 2, 8000);
    };
  };
  open();
  return {
    watch(sizes) {
      const entries = Array.isArray(sizes) ? sizes.map((id) => [id, null]) : Object.entries(sizes);
      const next = Object.fromEntries(entries.sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
      if (JSON.stringify(next) === JSON.stringify(watching)) return;  // same ids, same sizes
      watching = next;
      send();
    },
  };
}

/** One binary message -> [header, JPEG blob]. */
export function parseFrame(buf) {
  const n = new DataView(buf).getUint32(0, false);
  const head = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 4, n)));
  return [head, new Blob([new Uint8Array(buf, 4 + n)], { type: "image/jpeg" })];
}
