// Drawing one frame's results on that frame (the caller guarantees they share a seq).
// Coordinates are the stream's pixels: the frame canvas has the stream's size, whatever the size
// of the JPEG, so boxes and masks need no scaling.

import { decodeMask } from "./rle.js";

// Distinct colours for object ids; the outline of a mask is drawn fully opaque in exactly this
// colour (tests look for it), while boxes and labels are drawn translucent.
const PALETTE = [[78, 154, 241], [245, 166, 35], [126, 211, 33], [232, 74, 95], [184, 107, 255],
  [46, 196, 182], [255, 111, 145], [255, 209, 102], [6, 214, 160], [247, 140, 107]];

export function colorFor(id) {
  const n = PALETTE.length;
  return PALETTE[(((id - 1) % n) + n) % n];
}

export const css = ([r, g, b], a = 1) => `rgba(${r}, ${g}, ${b}, ${a})`;

const scratch = document.createElement("canvas");  // reused: one mask region at a time

/**
 * Draw every kind of result in `results` ({kind: message}) on ctx (sized w x h, the stream's pixels).
 * scale: canvas pixels per screen pixel (the canvas is scaled to its tile), so that text and lines
 * look the same size on a small tile and on a 4K stream's page.
 */
export function drawResults(ctx, results, w, h, scale = 1) {
  if (results.sam2) {
    for (const obj of results.sam2.objects || []) drawObject(ctx, obj, w, h, scale);
  }
  const lines = [];
  if (results.classify) {
    for (const [, label, p] of results.classify.topk || []) lines.push(`${shortLabel(label)}  ${pct(p)}`);
  }
  for (const [kind, r] of Object.entries(results)) {
    if (typeof r.latency_ms === "number") lines.push(`${kind} ${Math.round(r.latency_ms)} ms`);
  }
  drawTextBox(ctx, lines, 6 * scale, 6 * scale, scale);
}

function drawObject(ctx, obj, w, h, scale) {
  const color = colorFor(obj.id);
  if (obj.mask) drawMask(ctx, obj.mask, obj.bbox, color, w, h);
  if (!obj.bbox) return;  // an object with an empty mask (lost for now)
  const [x0, y0, x1, y1] = obj.bbox;
  ctx.save();
  ctx.strokeStyle = css(color, 0.85);
  ctx.lineWidth = 2 * scale;
  ctx.strokeRect(x0, y0, x1 - x0, y1 - y0);
  const text = `#${obj.id} ${typeof obj.score === "number" ? obj.score.toFixed(2) : ""}`;
  ctx.font = `${Math.round(12 * scale)}px system-ui, sans-serif`;
  const tw = ctx.measureText(text).width + 8 * scale, th = 16 * scale;
  const ty = y0 >= th ? y0 - th : y0;  // above the box, or inside it at the top edge
  ctx.fillStyle = css(color, 0.8);
  ctx.fillRect(x0, ty, tw, th);
  ctx.fillStyle = "#fff";
  ctx.textBaseline = "middle";
  ctx.fillText(text, x0 + 4 * scale, ty + th / 2);
  ctx.restore();
}

/**
 * A translucent fill with an opaque 1-pixel outline. Only the mask's bounding region is rasterized
 * (from the bbox when the result has one): a 1080p ImageData per object per frame would be 8 MB.
 */
function drawMask(ctx, rle, bbox, color, w, h) {
  const [mh, mw] = rle.size;
  const m = decodeMask(rle);
  const clamp = (v, hi) => Math.max(0, Math.min(hi, Math.round(v)));
  const [x0, y0, x1, y1] = bbox && mw === w && mh === h
    ? [clamp(bbox[0], mw), clamp(bbox[1], mh), clamp(bbox[2], mw), clamp(bbox[3], mh)]
    : bounds(m, mw, mh);
  if (x1 <= x0 || y1 <= y0) return;
  const rw = x1 - x0, rh = y1 - y0;
  const img = new ImageData(rw, rh);
  const [r, g, b] = color;
  const on = (x, y) => x >= 0 && y >= 0 && x < mw && y < mh && m[y * mw + x] === 1;
  for (let y = y0; y < y1; y++) {
    for (let x = x0; x < x1; x++) {
      if (!m[y * mw + x]) continue;
      const edge = !on(x - 1, y) || !on(x + 1, y) || !on(x, y - 1) || !on(x, y + 1);
      const i = ((y - y0) * rw + (x - x0)) * 4;
      img.data[i] = r; img.data[i + 1] = g; img.data[i + 2] = b;
      img.data[i + 3] = edge ? 255 : 100;
    }
  }
  scratch.width = rw;
  scratch.height = rh;
  scratch.getContext("2d").putImageData(img, 0, 0);
  const sx = w / mw, sy = h / mh;  // 1 unless a mask comes at another size than the stream
  ctx.save();
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(scratch, 0, 0, rw, rh, x0 * sx, y0 * sy, rw * sx, rh * sy);
  ctx.restore();
}

/** [x0, y0, x1, y1] (exclusive) of the set pixels of a row-major mask. */
function bounds(m, w, h) {
  let x0 = w, y0 = h, x1 = 0, y1 = 0;
  for (let y = 0; y < h; y++) {
    const row = y * w;
    for (let x = 0; x < w; x++) {
      if (m[row + x]) {
        if (x < x0) x0 = x;
        if (x >= x1) x1 = x + 1;
        if (y < y0) y0 = y;
        y1 = y + 1;
      }
    }
  }
  return [x0, y0, x1, y1];
}

function drawTextBox(ctx, lines, x, y, scale) {
  if (!lines.length) return;
  ctx.save();
  const size = Math.round(13 * scale), lh = size * 1.35, pad = 5 * scale;
  ctx.font = `${size}px system-ui, sans-serif`;
  const tw = Math.max(...lines.map((l) => ctx.measureText(l).width));
  ctx.fillStyle = "rgba(0, 0, 0, 0.6)";
  ctx.fillRect(x, y, tw + 2 * pad, lines.length * lh + 2 * pad);
  ctx.fillStyle = "#fff";
  ctx.textBaseline = "top";
  lines.forEach((l, i) => ctx.fillText(l, x + pad, y + pad + i * lh + (lh - size) / 2));
  ctx.restore();
}

/** ImageNet labels list synonyms ("tricycle, trike, velocipede"): the first is enough on a frame. */
export const shortLabel = (label) => String(label).split(",")[0];

export const pct = (p) => `${(p * 100).toFixed(p >= 0.1 ? 0 : 1)}%`;
