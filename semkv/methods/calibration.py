"""Per-model calibration files of methods that tune themselves offline (DynSplit-KV delimiter weights, CHESS
uncertainty thresholds): small JSON files under `$SEMKV_CACHE_DIR/calibration/<method>/`, one per model."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def _root() -> Path:
    return Path(os.environ.get("SEMKV_CACHE_DIR", Path.home() / ".cache" / "semkv")) / "calibration"


def calibration_path(method: str, model_source: str) -> Path:
    """Where `method`'s calibration for the model loaded from `model_source` lives."""
    source = str(Path(model_source).expanduser().resolve()) if model_source else "unknown"
    key = hashlib.sha1(source.encode()).hexdigest()[:16]
    return _root() / method / f"{Path(source).stem}-{key}.json"


def load(method: str, model_source: str) -> dict[str, Any] | None:
    path = calibration_path(method, model_source)
    return json.loads(path.read_text()) if path.is_file() else None


def save(method: str, model_source: str, data: dict[str, Any]) -> Path:
    path = calibration_path(method, model_source)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(data, model=model_source), indent=2))
    return path
