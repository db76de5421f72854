"""ab.csv: one row per result (step, case, metric, value, unit, note), appended and flushed as it comes."""

import csv
from pathlib import Path

FIELDS = ("step", "case", "metric", "value", "unit", "note")


class Rows:
    """ab.csv, appended and flushed row by row."""

    def __init__(self, out: Path, step: str):
        self.path, self.step = out / "ab.csv", step
        if not self.path.exists():
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(FIELDS)

    def add(self, case: str, metric: str, value, unit: str = "", note: str = "") -> None:
        if isinstance(value, float):
            value = f"{value:.6g}"
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow((self.step, case, metric, value, unit, note))
        print(f"{self.step:10} {case:34} {metric:18} {value} {unit} {note}", flush=True)
