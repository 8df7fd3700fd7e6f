// The page of one stream (/stream/{id}): a large tile, and on a SAM 2 stream, draw to track and
// the list of tracked objects.

import { PromptLayer } from "./draw.js";
import { h, showError, tryApi, wireErrorBox } from "./dom.js";
import { connect } from "./live.js";
import { colorFor, css } from "./overlay.js";
import { Tile } from "./tile.js";

const id = decodeURIComponent(location.pathname.replace(/^\/stream\//, "").replace(/\/+$/, ""));
const base = `/api/streams/${encodeURIComponent(id)}`;
document.title = `vidar · ${id}`;

const status = document.getElementById("status");
const missing = document.getElementById("missing");
const panel = document.getElementById("tracking");
const list = document.getElementById("objects");
const pointsBar = document.getElementById("points");

const tile = new Tile(id, {
  link: false,
  onRemove: async () => { if (await tryApi("DELETE", base)) location.assign("/"); },
  onResize: () => rewatch(),
});
document.getElementById("stream").append(tile.el);

// -- objects -----------------------------------------------------------------------------------
let layer = null;        // created once the state shows a SAM 2 pool on this stream
let listed = [];         // object ids in the last state (tracked and pending)
const asked = new Set(); // ids this page added: the next id skips them before the state lists them
const rows = new Map();  // object id -> {li, score}

const nextId = () => Math.max(0, ...listed, ...asked) + 1;

async function addObject(prompt) {
  const oid = nextId();
  asked.add(oid);
  if (!(await tryApi("POST", `${base}/objects`, { id: oid, ...prompt }))) asked.delete(oid);
}

function showObjects(ids) {
  listed = ids;
  for (const [oid, row] of rows) {
    if (!ids.includes(oid)) { row.li.remove(); rows.delete(oid); }
  }
  for (const oid of ids) {
    if (rows.has(oid)) continue;
    const score = h("span", { class: "score" }, "–");
    const li = h("li", { class: "object", "data-object": oid, "data-color": colorFor(oid).join(",") },
      h("i", { class: "swatch", style: `background:${css(colorFor(oid))}` }), h("b", {}, `#${oid}`), score,
      h("button", { class: "remove-object", title: `stop tracking object ${oid}`,
        onclick: () => tryApi("DELETE", `${base}/objects/${oid}`) }, "Remove"));
    rows.set(oid, { li, score });
    list.append(li);
  }
  list.querySelector(".none")?.remove();
  if (!ids.length) list.append(h("li", { class: "none muted" }, "no objects: draw one on the frame"));
}

// Scores come with the frame on show (not with the state), so they match what is drawn.
tile.onDraw = (results) => {
  const objs = new Map((results.sam2?.objects || []).map((o) => [o.id, o]));
  for (const [oid, row] of rows) {
    const o = objs.get(oid);
    // no SAM 2 result on this frame / not in it yet (the prompt waits for the next frame) / empty mask
    row.score.textContent = !results.sam2 ? "–" : !o ? "pending" : o.bbox ? `score ${o.score.toFixed(2)}` : "lost";
  }
};

function showPoints(points) {
  pointsBar.hidden = points.length === 0;
  const bg = points.filter((p) => p[2] === 0).length;
  pointsBar.querySelector(".count").textContent =
    `${points.length - bg} object point(s), ${bg} background point(s)`;
}

function sendPoints() {
  if (!layer?.points.length) return;
  if (!layer.points.some((p) => p[2] === 1)) {  // background points alone name nothing to track
    showError("add at least one object point (a click without shift)");
    return;
  }
  addObject({ points: layer.points });
  layer.clear();
}

pointsBar.querySelector(".send").addEventListener("click", sendPoints);
pointsBar.querySelector(".clear").addEventListener("click", () => layer?.clear());
document.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && ev.target === document.body) sendPoints();
  if (ev.key === "Escape") layer?.clear();
});

// -- live ----------------------------------------------------------------------------------------
const rewatch = () => live.watch({ [id]: tile.wanted() });  // at the size the tile shows it
const live = connect({
  onStatus: (s) => { status.textContent = s; status.className = s === "live" ? "ok" : "bad"; },
  onFrame: (head, jpeg) => { if (head.stream === id) tile.frame(head, jpeg); },
  onState(msg) {
    const s = msg.streams[id];
    missing.hidden = Boolean(s);
    tile.el.hidden = !s;
    rewatch();  // a tile shown again has a size again
    if (!s) return;
    tile.state(s, msg);
    const tracks = Array.isArray(s.objects);  // only streams on the SAM 2 pool list objects
    panel.hidden = !tracks;
    if (tracks) {
      layer ||= new PromptLayer(tile, { onBox: (box) => addObject({ box }), onPointsChange: showPoints });
      showObjects(s.objects);
    }
  },
});
rewatch();
wireErrorBox();
