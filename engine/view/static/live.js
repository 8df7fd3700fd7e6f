// The live view's WebSocket (protocol in engine/view/server.py): the page says which streams it
// shows ({"watch": [ids]}); the server sends the state once a second as text, and each watched
// stream's shown frame as binary: a 4-byte big-endian length n, n bytes of JSON (the frame's
// header, with the results of that same frame), then the JPEG.

/**
 * Connect, and reconnect with a capped backoff (the engine may restart; the page stays open).
 * Returns {watch(ids)}: call it whenever the set of shown streams changes.
 */
export function connect({ onState, onFrame, onStatus }) {
  let ws = null;
  let watching = [];
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
    watch(ids) {
      const next = [...ids].sort();
      if (next.join("\n") === watching.join("\n")) return;
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
