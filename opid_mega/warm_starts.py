"""Warm starts shipped with the package: `model.init_from: shipped:NAME` names opid_mega/data/warm_starts/NAME (an
HF directory with weights, config and tokenizer, committed). No torch here: the planner and the start-up checks read
it too."""
from __future__ import annotations

from pathlib import Path

SHIPPED = "shipped:"
SHIPPED_DIR = Path(__file__).resolve().parent / "data" / "warm_starts"


def shipped_names() -> list:
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file()) \
        if SHIPPED_DIR.is_dir() else []


def shipped_model(name: str) -> str:
    """The directory of the shipped warm start NAME; FileNotFoundError naming the shipped ones otherwise."""
    d = SHIPPED_DIR / name
    if not name or "/" in name or "\\" in name or name.startswith(".") or not (d / "config.json").is_file():
        raise FileNotFoundError(f"{SHIPPED}{name}: no warm start of that name is shipped (shipped: "
                                f"{', '.join(SHIPPED + n for n in shipped_names()) or 'none'})")
    return str(d)


def model_dir(path: str) -> str:
    """PATH with `shipped:NAME` replaced by that warm start's directory (any other path unchanged)."""
    return shipped_model(path[len(SHIPPED):]) if path.startswith(SHIPPED) else path
