"""Drawing shared by the examples: a palette per object id and readable labels."""

from __future__ import annotations

import cv2
import numpy as np

# Distinct RGB colours, one per object id (cycled).
PALETTE = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
           (145, 30, 180), (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212)]


def label(img: np.ndarray, text: str, x: int, y: int, colour) -> None:
    """Black text on a filled box in the object's colour (readable over any mask), above (x, y)
    or just below it when there is no room above."""
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, 0.45, 1)
    top = y - th - base - 4 if y - th - base - 4 >= 0 else y
    x = min(x, img.shape[1] - tw - 4)
    cv2.rectangle(img, (x, top), (x + tw + 4, top + th + base + 4), colour, cv2.FILLED)
    cv2.putText(img, text, (x + 2, top + th + 2), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1, cv2.LINE_AA)
