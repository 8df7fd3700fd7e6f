// COCO run-length masks as SAM 2 results carry them ({"size": [h, w], "counts": "<string>"}), decoded
// in the page: sending bitmaps would cost ~100x the bytes of the RLE.

/**
 * The run lengths of a compressed COCO RLE string: a port of pycocotools' rleFrString.
 * Each count is a LEB128-like number in 5-bit chunks (printable: chunk + 48; 0x20 = more chunks
 * follow, 0x10 in the last chunk = negative). From the fourth count on, the string holds the
 * difference to the count two places before (the same kind of run: zeros or ones).
 */
export function rleCounts(s) {
  const counts = [];
  let p = 0;
  while (p < s.length) {
    let x = 0, k = 0, more = true;
    while (more) {
      const c = s.charCodeAt(p) - 48;
      x |= (c & 0x1f) << (5 * k);
      more = (c & 0x20) !== 0;
      p++;
      k++;
      if (!more && (c & 0x10)) x |= -1 << (5 * k);  // sign-extend
    }
    if (counts.length > 2) x += counts[counts.length - 2];
    counts.push(x);
  }
  return counts;
}

/**
 * Decode a mask to a row-major Uint8Array of h * w (1 = object), ready to draw.
 * The runs are column-major (Fortran order, as pycocotools) and start with a run of zeros.
 * Runs past h * w are ignored: a malformed result must not break the page.
 */
export function decodeMask({ size: [h, w], counts }) {
  const runs = typeof counts === "string" ? rleCounts(counts) : counts;
  const out = new Uint8Array(h * w);
  const n = h * w;
  let p = 0;
  for (let i = 0; i < runs.length && p < n; i++) {
    const end = Math.min(n, p + Math.max(0, runs[i]));
    if (i % 2 === 1) {
      for (let q = p; q < end; q++) out[(q % h) * w + ((q / h) | 0)] = 1;
    }
    p = end;
  }
  return out;
}
