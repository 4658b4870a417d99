"""The self-contained HTML dashboard written at the end of fit.

One file: the run's records as inline JSON, and inline CSS and JavaScript that draw SVG charts
when the page opens (the page, its style and its script are ``assets/dashboard.*``, package data
of this package). Nothing is fetched from the network, so the file opens from disk, from an
e-mail attachment or from a CI artefact. The page follows the reader's ``prefers-color-scheme``
unless ``dashboard_theme`` pins ``"light"`` or ``"dark"``; a button in the page cycles the theme.

When the charts are drawn the page sets ``data-ready="1"`` on ``<body>``, and every chart's
``<svg>`` carries ``data-points`` (points drawn) and ``data-events`` (event markers drawn) so
that a headless browser can check it.

Lost and joined ranks (``event`` records labelled ``rank_lost`` and ``rank_joined``) are a marker
on the time axis of every chart (a vertical line, its label names the ranks; hover shows the
reasons), a card and a table. Per-rank series follow each rank's number at launch (the sync
records' ``ranks``; a joiner's member id), so a rank keeps its colour when the ranks are
renumbered, a lost rank's line ends at its marker and a joiner's starts at its marker.
"""

from __future__ import annotations

import functools
import html
import importlib.resources
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

from lightning_elche.monitor.record import clean, read_records, write_atomically

THEMES = ("auto", "light", "dark")

MAX_POINTS = 4000
"""Sync records drawn at most (evenly thinned beyond that; the last one is always kept)."""


def validate_theme(theme: Optional[str], owner: str = "ElCheMonitor") -> str:
    """``None`` means ``"auto"``; anything else must be one of :data:`THEMES`."""
    if theme is None:
        return "auto"
    if not isinstance(theme, str) or theme.lower() not in THEMES:
        raise ValueError(f"{owner}(dashboard_theme={theme!r}) is invalid: expected one of 'light', 'dark', 'auto'.")
    return theme.lower()


def thin(records: list[Any], limit: int = MAX_POINTS) -> list[Any]:
    """At most ``limit`` records, evenly spaced, first and last kept."""
    if len(records) <= limit or limit < 2:
        return list(records)
    step = (len(records) - 1) / (limit - 1)
    picked = sorted({round(i * step) for i in range(limit)} | {len(records) - 1})
    return [records[i] for i in picked]


def dashboard_point(root: Mapping[str, Any]) -> dict[str, Any]:
    """The compact projection of one root ``sync`` record that the dashboard draws."""
    per_rank = root.get("per_rank") or {}
    metrics = root.get("metrics") or {}
    point: dict[str, Any] = {
        "t": root.get("t"),
        "sync": root.get("sync"),
        "epoch": root.get("epoch"),
        "cohort_step": root.get("cohort_step"),
        "anchor": root.get("anchor"),
        "overhead": root.get("overhead"),
        "window_steps": root.get("work"),
        "per_rank": {k: per_rank[k] for k in ("loss", "batch_share", "samples_per_s") if k in per_rank},
    }
    if root.get("ranks") is not None:
        point["ranks"] = list(root["ranks"])  # the launch number of each row of per_rank
    for key in ("loss", "samples_per_s"):
        if key in metrics:
            point[key] = metrics[key]
    if root.get("divergence") is not None:
        point["divergence"] = root["divergence"]
    return point


def event_marker(record: Mapping[str, Any]) -> dict[str, Any]:
    """The marker of one ``event`` record: where it goes on the time axis, its label and its details."""
    label = str(record.get("label") or "event")
    marker: dict[str, Any] = {"t": record.get("t"), "label": label, "sync": record.get("sync"),
                              "epoch": record.get("epoch")}
    if label == "rank_lost":
        lost = [int(r) for r in record.get("lost") or []]
        reasons = record.get("reasons") or {}
        marker.update({
            "generation": record.get("generation"),
            "lost": lost,
            "reasons": {str(k): str(v) for k, v in reasons.items()},
            "survivors": record.get("survivors"),
            "text": _ranks_text(lost) + " lost",
        })
    elif label == "rank_joined":
        joined = [int(r) for r in record.get("joined") or []]
        marker.update({
            "generation": record.get("generation"),
            "joined": joined,
            "world_size": record.get("world_size"),
            "text": _ranks_text(joined) + " joined",
        })
    else:
        marker["text"] = label
    return marker


def _ranks_text(ranks: list[int]) -> str:
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(str(r) for r in ranks)


def dashboard_data(records: Iterable[Mapping[str, Any]], dropped: int = 0) -> dict[str, Any]:
    """What the page draws, from root records (``meta``, ``sync``, ``scalars``, ``eval``, ``epoch``,
    ``event``, ``end``)."""
    meta: dict[str, Any] = {}
    syncs: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    scalars: list[dict[str, Any]] = []
    epochs: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    ranks: list[Any] = []
    t_end = 0.0
    for record in records:
        kind = record.get("kind")
        t = record.get("t")
        if isinstance(t, (int, float)):
            t_end = max(t_end, float(t))
        if kind == "meta":
            meta = {k: v for k, v in record.items() if k not in ("kind", "v", "node", "rank")}
            dropped = max(dropped, int(record.get("dropped") or 0))
        elif kind == "sync":
            syncs.append(dashboard_point(record))
        elif kind == "scalars":
            scalars.append({"t": t, "sync": record.get("sync"), "values": record.get("scalars") or {}})
        elif kind == "eval":
            evals.append({"t": t, "epoch": record.get("epoch"), "metrics": record.get("metrics") or {}})
        elif kind == "epoch":
            epochs.append({"epoch": record.get("epoch"), "start": record.get("start"), "end": t})
        elif kind == "event":
            events.append(event_marker(record))
        elif kind == "end":
            ranks = list(record.get("ranks") or [])
    world = meta.get("world_size", 1)
    mode = (meta.get("config") or {}).get("mode", "?")
    lost = sum(len(e.get("lost") or []) for e in events if e["label"] == "rank_lost")
    joined = sum(len(e.get("joined") or []) for e in events if e["label"] == "rank_joined")
    return {
        "title": f"ElChe run · {mode} · {world} rank{'s' if world != 1 else ''}" + (f" · {lost} lost" if lost else "")
        + (f" · {joined} joined" if joined else ""),
        "meta": meta,
        "syncs": syncs,
        "evals": evals,
        "scalars": scalars,
        "epochs": epochs,
        "events": events,
        "ranks": ranks,
        "t_end": t_end,
        "dropped": dropped,
    }


def dashboard_from_log(
    record_log: Union[str, os.PathLike], path: Union[str, os.PathLike], theme: Optional[str] = None
) -> None:
    """Rebuild the dashboard from a record log: its ``root.jsonl`` (or the directory holding it).

    Useful after a run that died before writing its dashboard, or to re-theme one.
    """
    source = os.fspath(record_log)
    if os.path.isdir(source):
        source = os.path.join(source, "root.jsonl")
    write_dashboard(path, dashboard_data(read_records(source)), theme)


def render_dashboard(data: Mapping[str, Any], theme: Optional[str] = None) -> str:
    """The dashboard page for ``data`` (the shape :func:`dashboard_data` returns)."""
    theme = validate_theme(theme)
    payload = dict(data)
    payload["syncs"] = thin(list(payload.get("syncs") or []))
    payload["scalars"] = thin(list(payload.get("scalars") or []))
    text = json.dumps(clean(payload), separators=(",", ":"), allow_nan=False)
    # Inside <script type="application/json"> only "</" could end the element early.
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = html.escape(str(payload.get("title") or "ElChe run"))
    theme_attr = "" if theme == "auto" else f' data-theme="{theme}"'
    return (
        _asset("dashboard.html").replace("__THEME_ATTR__", theme_attr)
        .replace("__TITLE__", title)
        .replace("__CSS__", _asset("dashboard.css"))
        .replace("__JS__", _asset("dashboard.js"))
        .replace("__DATA__", text)
    )


@functools.cache
def _asset(name: str) -> str:
    """A file of the page (``assets/`` beside this module, package data of the wheel)."""
    return (importlib.resources.files(__package__) / "assets" / name).read_text(encoding="utf-8")


def write_dashboard(path: Union[str, os.PathLike], data: Mapping[str, Any], theme: Optional[str] = None) -> None:
    """Render and write atomically (a reader never sees half a page)."""
    write_atomically(path, render_dashboard(data, theme))

