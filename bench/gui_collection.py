"""How long one full garbage collection holds the GUI thread in a window with a
model and a read-out on the heap: what every worker's end cost before the app
stopped forcing one (app/workers.py; it now switches automatic collection back
on and lets Python's thresholds collect young objects first).

    QT_QPA_PLATFORM=offscreen python bench/gui_collection.py [--repeats 5]

Prints the milliseconds of ``gc.collect()`` (every generation) and of
``gc.collect(0)`` (the youngest), and the number of objects the collector tracks.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from PySide6.QtWidgets import QApplication


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    app = QApplication([])
    from app.main_window import MainWindow
    from core import load_model
    from core.analyze import analyze
    from core.files.images import load_image
    from core.models.loading import resources_dir

    window = MainWindow()
    window.show()
    loaded = load_model("shapes-llava")
    image = load_image(resources_dir() / "samples" / "sample_00.png")
    result = analyze(loaded, image, "what color is the circle?")  # noqa: F841 (kept on the heap, as the window keeps it)

    def timed(fn) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times)

    full, young = timed(gc.collect), timed(lambda: gc.collect(0))
    print(f"tracked objects: {len(gc.get_objects()):,}")
    print(f"full collection: {full:.0f} ms; youngest generation: {young:.1f} ms (medians of {args.repeats})")
    window.close()
    app.processEvents()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
