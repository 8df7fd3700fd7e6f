// The latency chart of one pool on one stream: p50 and p99 over the last minute against the budget.

const WINDOW_S = 60;
export const COLORS = { p50: "#4e9af1", p99: "#f5a623", budget: "#e84a5f" };

/** history: [[unix_s, p50_ms | null, p99_ms | null], ...] (one point a second); now: the state's t. */
export function drawChart(canvas, history, budgetMs, now) {
  // Sized from its box so lines stay sharp on any screen; hidden tiles keep their last size.
  const dpr = window.devicePixelRatio || 1;
  const cw = Math.round((canvas.clientWidth || canvas.width) * dpr);
  const ch = Math.round((canvas.clientHeight || canvas.height) * dpr);
  if (canvas.width !== cw || canvas.height !== ch) {
    canvas.width = cw;
    canvas.height = ch;
  }
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, cw, ch);
  const peak = Math.max(0, ...history.map(([, , p99]) => p99 ?? 0));
  // A log scale: a 15 ms p50 stays readable beside a 1 s budget, and so does a p99 ten times over it.
  const top = Math.max(budgetMs * 1.25, peak * 1.1, 1);
  const low = top / 1000;
  const pad = 3 * dpr;
  const X = (t) => ((t - (now - WINDOW_S)) / WINDOW_S) * cw;
  const Y = (ms) => ch - pad - (Math.log(Math.max(ms, low) / low) / Math.log(top / low)) * (ch - 2 * pad);

  ctx.font = `${9 * dpr}px system-ui, sans-serif`;
  ctx.textBaseline = "top";
  for (let ms = 10 ** Math.ceil(Math.log10(low)); ms < top; ms *= 10) {  // a faint line per decade
    ctx.fillStyle = "rgba(255, 255, 255, 0.08)";
    ctx.fillRect(0, Math.round(Y(ms)), cw, dpr);
    ctx.fillStyle = "rgba(255, 255, 255, 0.35)";
    ctx.fillText(ms >= 1000 ? `${ms / 1000} s` : `${ms} ms`, 2 * dpr, Y(ms) + dpr);
  }

  ctx.lineWidth = dpr;
  ctx.setLineDash([4 * dpr, 3 * dpr]);
  ctx.strokeStyle = COLORS.budget;
  ctx.beginPath();
  ctx.moveTo(0, Y(budgetMs));
  ctx.lineTo(cw, Y(budgetMs));
  ctx.stroke();
  ctx.setLineDash([]);

  ctx.lineWidth = 1.5 * dpr;
  for (const [i, key] of [[1, "p50"], [2, "p99"]]) {
    ctx.strokeStyle = COLORS[key];
    ctx.beginPath();
    let drawing = false;
    for (const point of history) {
      const v = point[i];
      if (v === null || v === undefined) {  // nothing published in that second: a gap, not a zero
        drawing = false;
        continue;
      }
      if (drawing) ctx.lineTo(X(point[0]), Y(v));
      else ctx.moveTo(X(point[0]), Y(v));
      drawing = true;
    }
    ctx.stroke();
  }
}
