// Draw to track: a layer over a tile's frame where the user drags a box, or clicks points
// (shift-click: a background point), to prompt SAM 2 with a new object. The prompt is drawn on its
// own canvas so that frames arriving meanwhile do not erase it.

const DRAG_PX = 5;  // a press that moves less than this (screen pixels) is a click: a point

export class PromptLayer {
  /** onBox([x0, y0, x1, y1]) fires at once; points wait in `points` until the page sends them. */
  constructor(tile, { onBox, onPointsChange }) {
    this.tile = tile;
    this.onBox = onBox;
    this.onPointsChange = onPointsChange;
    this.points = [];   // [[x, y, 1 | 0], ...] in stream pixels
    this.drag = null;   // {x0, y0, x1, y1, sx, sy, moved} while the button is down
    this.canvas = document.createElement("canvas");
    this.canvas.className = "prompt";
    tile.view.append(this.canvas);
    this.canvas.addEventListener("pointerdown", (ev) => this.down(ev));
    this.canvas.addEventListener("pointermove", (ev) => this.move(ev));
    this.canvas.addEventListener("pointerup", (ev) => this.up(ev));
    this.canvas.addEventListener("pointercancel", () => { this.drag = null; this.render(); });
  }

  /** Stream pixels under the pointer (the canvas is scaled to fit the tile). */
  at(ev) {
    const [w, h] = this.tile.size;
    const r = this.canvas.getBoundingClientRect();
    const clamp = (v, hi) => Math.max(0, Math.min(hi, v));
    return [Math.round(clamp(((ev.clientX - r.left) / r.width) * w, w)),
      Math.round(clamp(((ev.clientY - r.top) / r.height) * h, h))];
  }

  down(ev) {
    if (!this.tile.size || ev.button !== 0) return;  // nothing to draw on before the first frame
    ev.preventDefault();
    this.canvas.setPointerCapture(ev.pointerId);
    const [x, y] = this.at(ev);
    this.drag = { x0: x, y0: y, x1: x, y1: y, sx: ev.clientX, sy: ev.clientY, moved: false };
  }

  move(ev) {
    if (!this.drag) return;
    [this.drag.x1, this.drag.y1] = this.at(ev);
    this.drag.moved ||= Math.hypot(ev.clientX - this.drag.sx, ev.clientY - this.drag.sy) >= DRAG_PX;
    this.render();
  }

  up(ev) {
    const d = this.drag;
    if (!d) return;
    this.drag = null;
    [d.x1, d.y1] = this.at(ev);
    if (d.moved) {
      const box = [Math.min(d.x0, d.x1), Math.min(d.y0, d.y1), Math.max(d.x0, d.x1), Math.max(d.y0, d.y1)];
      if (box[2] > box[0] && box[3] > box[1]) this.onBox(box);
    } else {
      this.points.push([d.x0, d.y0, ev.shiftKey ? 0 : 1]);
      this.onPointsChange(this.points);
    }
    this.render();
  }

  clear() {
    this.points = [];
    this.onPointsChange(this.points);
    this.render();
  }

  render() {
    const size = this.tile.size || [1, 1];
    if (this.canvas.width !== size[0] || this.canvas.height !== size[1]) [this.canvas.width, this.canvas.height] = size;
    const ctx = this.canvas.getContext("2d");
    ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    const s = size[0] / (this.canvas.clientWidth || size[0]);  // canvas pixels per screen pixel
    ctx.lineWidth = 2 * s;
    if (this.drag?.moved) {
      const { x0, y0, x1, y1 } = this.drag;
      ctx.setLineDash([6 * s, 4 * s]);
      ctx.strokeStyle = "#fff";
      ctx.strokeRect(Math.min(x0, x1), Math.min(y0, y1), Math.abs(x1 - x0), Math.abs(y1 - y0));
      ctx.setLineDash([]);
    }
    for (const [x, y, label] of this.points) {  // green: object, red: background
      ctx.fillStyle = label ? "#3ddc84" : "#ff4d4f";
      ctx.strokeStyle = "#000";
      ctx.beginPath();
      ctx.arc(x, y, 5 * s, 0, 2 * Math.PI);
      ctx.fill();
      ctx.stroke();
    }
  }
}
