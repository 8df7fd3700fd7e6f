// One stream's tile: its frames with their results, its state, rates, drops and latency chart.

import { COLORS, drawChart } from "./chart.js";
import { h } from "./dom.js";
import { drawResults, pct, shortLabel } from "./overlay.js";

// The frame size a tile asks for is rounded up to a step, so that a pixel of layout jitter does not make
// the server re-encode, and re-sent only once a resize has settled.
const SIZE_STEP = 64;
const RESIZE_SETTLE_MS = 300;

export class Tile {
  /** onRemove(id): the tile's remove button; link: the title links to the stream's own page;
   * onResize(): the size the frame is shown at changed (settled), see wanted(). */
  constructor(id, { onRemove, onResize, link = true } = {}) {
    this.id = id;
    this.size = null;        // [w, h] of the stream, from the last frame header
    this.results = {};       // the results drawn on the frame on show
    this.busy = false;       // a JPEG is being decoded
    this.queued = null;      // the newest frame that arrived meanwhile (older ones are skipped)
    this.pools = new Map();  // pool name -> its stats elements
    const title = link ? h("a", { href: `/stream/${encodeURIComponent(id)}` }, id) : id;
    this.canvas = h("canvas", { class: "frame", id: `frame-${id}` });
    this.el = h("article", { class: "tile", "data-stream": id, "data-state": "" },
      h("header", {},
        h("h2", {}, title),
        this.badge = h("span", { class: "state" }, "…"),
        onRemove && h("button", { class: "remove-stream", title: `remove stream ${id}`, onclick: () => onRemove(id) },
          "Remove")),
      this.url = h("div", { class: "url" }),
      this.lag = h("div", { class: "lag", hidden: true }),
      this.reason = h("div", { class: "reason", hidden: true }),
      this.view = h("div", { class: "view" }, this.canvas,
        this.behind = h("div", { class: "behind", hidden: true }),
        this.waiting = h("div", { class: "waiting" }, "waiting for frames…")),
      this.caption = h("div", { class: "caption" }),
      this.stats = h("div", { class: "stats" }));
    let timer = null;
    this.resizes = new ResizeObserver(() => {
      clearTimeout(timer);
      timer = setTimeout(() => onResize?.(), RESIZE_SETTLE_MS);
    });
    this.resizes.observe(this.canvas);
  }

  /** The frame size this tile needs: the longer side of the frame as shown, in device pixels, rounded
   * up to SIZE_STEP (more would only cost the browser decoding). null while not laid out (hidden). */
  wanted() {
    const r = this.canvas.getBoundingClientRect();
    const px = Math.max(r.width, r.height) * (window.devicePixelRatio || 1);
    return px > 0 ? Math.ceil(px / SIZE_STEP) * SIZE_STEP : null;
  }

  /** The tile leaves the page. */
  close() {
    this.resizes.disconnect();
    this.el.remove();
  }

  // -- frames ------------------------------------------------------------------------------------
  /** A frame and its results (one binary message). JPEGs are decoded one at a time, in order, and
   * only the newest waiting frame is kept: a slow page skips frames instead of falling behind. */
  frame(head, jpeg) {
    this.queued = { head, jpeg };
    if (!this.busy) this.drain();
  }

  async drain() {
    this.busy = true;
    while (this.queued) {
      const { head, jpeg } = this.queued;
      this.queued = null;
      let bitmap;
      try {
        bitmap = await createImageBitmap(jpeg);
      } catch {
        continue;  // a broken JPEG: keep what is on show
      }
      this.draw(head, bitmap);
      bitmap.close();
    }
    this.busy = false;
  }

  /** Frame and overlay in one synchronous step: nothing can interleave another seq's results. */
  draw(head, bitmap) {
    const { width: w, height: h, results = {} } = head;
    // The canvas keeps the JPEG's size (what wanted() asked, at most view.max_side): scaling it back up to
    // the stream's size would only cost the browser pixels. Results are in stream pixels: drawn through a
    // transform.
    const [bw, bh] = [bitmap.width, bitmap.height];
    if (this.canvas.width !== bw || this.canvas.height !== bh) {
      this.canvas.width = bw;
      this.canvas.height = bh;
    }
    this.canvas.dataset.frameSize = `${bw}x${bh}`;  // what the server sent (tests read it)
    this.size = [w, h];
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.drawImage(bitmap, 0, 0);
    ctx.setTransform(bw / w, 0, 0, bh / h, 0, 0);
    drawResults(ctx, results, w, h, w / (this.canvas.clientWidth || w));
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    this.results = results;
    const seqs = [...new Set(Object.values(results).map((r) => r.seq))];
    this.el.dataset.frameSeq = head.seq;
    this.el.dataset.resultSeq = seqs.join(",");  // "" when the frame came without results
    this.waiting.hidden = true;
    this.showCaption(results);
    this.onDraw?.(results);
  }

  showCaption(results) {
    const parts = [];
    const top = results.classify?.topk?.[0];
    if (top) parts.push(h("span", { class: "top1" }, `${shortLabel(top[1])} ${pct(top[2])}`));
    if (results.sam2) parts.push(h("span", { class: "objects" }, `${results.sam2.objects?.length ?? 0} object(s)`));
    for (const [kind, r] of Object.entries(results)) {
      if (typeof r.latency_ms !== "number") continue;
      parts.push(h("span", { class: "latency" }, `${kind} ${Math.round(r.latency_ms)} ms`));
    }
    if (results.classify?.weights === "random") parts.push(h("span", { class: "warn" }, "random weights"));
    this.caption.replaceChildren(...parts);
  }

  // -- state (once a second; it never touches the canvas) ----------------------------------------
  state(s, msg) {
    this.el.dataset.state = s.state;
    this.badge.textContent = s.state;
    this.badge.className = `state state-${s.state}`;
    this.url.textContent = `${s.url} · ${s.mode}`;
    const why = s.reason || (s.state !== "running" && s.event?.kind !== "started" ? s.event?.reason : "");
    this.reason.hidden = !why;
    this.reason.textContent = why || "";
    this.showBehind(s.view || {}, msg.budget_ms);
    this.showLag(s.lag_s, msg.budget_ms);
    const names = Object.keys(s.pools || {});
    for (const [name, p] of Object.entries(s.pools || {})) this.pool(name).update(p, msg);
    for (const [name, el] of this.pools) {
      if (!names.includes(name)) { el.root.remove(); this.pools.delete(name); }
    }
  }

  /** When results lag, the server shows the newest frame that has results: say how far behind the newest
   * frame a worker took it is. Frames still within the latency budget are not lagging: results normally
   * take that long, and a banner that flickers on every frame in flight would say nothing. */
  showBehind({ behind_frames: n = 0, behind_s: secs = 0 }, budgetMs = 0) {
    const lagging = n > 0 && (secs ?? 0) * 1000 > budgetMs;
    this.behind.hidden = !lagging;
    this.behind.textContent = lagging ? `${n} frame${n === 1 ? "" : "s"} / ${(secs ?? 0).toFixed(1)} s behind live` : "";
  }

  /** A live network stream: how far behind its camera its packets are read (the lag behind the live edge).
   * Past the latency budget its frames are dropped as deadline and it skips ahead to a keyframe: shown in
   * the warning colour then. Other streams (files, synthetic) have no lag: hidden. */
  showLag(lag, budgetMs = 0) {
    const known = typeof lag === "number";
    this.lag.hidden = !known;
    this.lag.textContent = known ? `behind live: ${lag < 1 ? `${Math.round(lag * 1000)} ms` : `${lag.toFixed(1)} s`}` : "";
    this.lag.classList.toggle("bad", known && lag * 1000 > budgetMs);
  }

  pool(name) {
    if (!this.pools.has(name)) {
      const el = {};
      el.root = h("section", { class: "pool", "data-pool": name },
        h("div", { class: "line" }, h("b", {}, name), el.rates = h("span", { class: "rates" })),
        el.drops = h("div", { class: "drops" }),
        el.chart = h("canvas", { class: "chart" }),
        el.legend = h("div", { class: "legend" }));
      el.update = (p, msg) => this.updatePool(el, p, msg);
      this.stats.append(el.root);
      this.pools.set(name, el);
    }
    return this.pools.get(name);
  }

  updatePool(el, p, msg) {
    const fps = (v) => (v === null || v === undefined ? "–" : v.toFixed(1));
    const ms = (v) => (v === null || v === undefined ? "–" : `${Math.round(v)} ms`);
    el.rates.textContent = `in ${fps(p.fps_in)} fps · out ${fps(p.fps_out)} fps · in flight ${p.in_flight}`;
    const list = (o) => Object.entries(o || {}).map(([k, v]) => `${k} ${v}`).join(", ");
    const dropped = list(p.dropped), failed = list(p.failed);
    el.drops.textContent = `dropped: ${dropped || "none"}` + (failed ? ` · failed: ${failed}` : "");
    el.drops.classList.toggle("bad", Boolean(failed));
    drawChart(el.chart, p.history || [], msg.budget_ms, msg.t);
    const dot = (color) => h("i", { style: `background:${color}` });
    el.legend.replaceChildren(
      h("span", {}, dot(COLORS.p50), `p50 ${ms(p.p50_ms)}`),
      h("span", {}, dot(COLORS.p99), `p99 ${ms(p.p99_ms)}`),
      h("span", {}, dot(COLORS.budget), `budget ${ms(msg.budget_ms)}`),
      h("span", { class: "muted" }, "last 60 s, log scale"));
  }
}
