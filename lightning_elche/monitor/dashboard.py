"""The self-contained HTML dashboard written at the end of fit.

One file: the run's records as inline JSON, and inline CSS and JavaScript that draw SVG charts
when the page opens. Nothing is fetched from the network, so the file opens from disk, from an
e-mail attachment or from a CI artefact. The page follows the reader's ``prefers-color-scheme``
unless ``dashboard_theme`` pins ``"light"`` or ``"dark"``; a button in the page cycles the theme.

When the charts are drawn the page sets ``data-ready="1"`` on ``<body>``, and every chart's
``<svg>`` carries ``data-points`` (points drawn) and ``data-events`` (event markers drawn) so
that a headless browser can check it.

Lost ranks (``event`` records labelled ``rank_lost``) are a marker on the time axis of every
chart (a vertical line, its label names the lost ranks; hover shows the reasons), a card and a
table. Per-rank series follow each rank's number at launch (the sync records' ``ranks``), so a
rank keeps its colour when the survivors are renumbered and a lost rank's line ends at its marker.
"""

from __future__ import annotations

import html
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
            "text": ("ranks " if len(lost) > 1 else "rank ") + ", ".join(str(r) for r in lost) + " lost",
        })
    else:
        marker["text"] = label
    return marker


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
    return {
        "title": f"ElChe run · {mode} · {world} rank{'s' if world != 1 else ''}" + (f" · {lost} lost" if lost else ""),
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
        _TEMPLATE.replace("__THEME_ATTR__", theme_attr)
        .replace("__TITLE__", title)
        .replace("__CSS__", _CSS)
        .replace("__JS__", _JS)
        .replace("__DATA__", text)
    )


def write_dashboard(path: Union[str, os.PathLike], data: Mapping[str, Any], theme: Optional[str] = None) -> None:
    """Render and write atomically (a reader never sees half a page)."""
    write_atomically(path, render_dashboard(data, theme))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"__THEME_ATTR__>
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<title>__TITLE__</title>
<style>__CSS__</style>
</head>
<body>
<header class="top">
  <div>
    <h1 id="title">__TITLE__</h1>
    <div class="sub" id="subtitle"></div>
  </div>
  <button id="theme" type="button" title="Cycle the theme: auto, light, dark">theme: auto</button>
</header>
<section class="cards" id="cards"></section>
<main class="grid" id="charts"></main>
<section class="tables" id="tables"></section>
<footer id="footer"></footer>
<div class="tip" id="tip" hidden></div>
<script type="application/json" id="elche-data">__DATA__</script>
<script>__JS__</script>
</body>
</html>
"""

_LIGHT = """--bg:#f4f6f9;--panel:#ffffff;--fg:#18202e;--muted:#5f6b7d;--grid:#e6e9ef;--axis:#9aa4b4;
--border:#dfe3ea;--epoch:#8a94a6;--event:#dc2626;--accent:#2f6fe4;--total:#18202e;--shadow:0 1px 2px rgba(16,24,40,.06);
color-scheme:light;"""
_DARK = """--bg:#0e1117;--panel:#161b24;--fg:#e6e9ef;--muted:#98a2b3;--grid:#262d3a;--axis:#5b6577;
--border:#272e3b;--epoch:#6b7588;--event:#f87171;--accent:#6ea0ff;--total:#e6e9ef;--shadow:none;color-scheme:dark;"""

_CSS = (
    ":root{" + _LIGHT + "}"
    "@media (prefers-color-scheme: dark){:root:not([data-theme=light]){" + _DARK + "}}"
    ":root[data-theme=dark]{" + _DARK + "}"
    """
*{box-sizing:border-box}
body{margin:0;padding:20px 24px 28px;background:var(--bg);color:var(--fg);
 font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
.top{display:flex;justify-content:space-between;align-items:flex-start;gap:16px;margin-bottom:14px}
h1{font-size:20px;margin:0 0 2px;font-weight:650;letter-spacing:-.01em}
.sub{color:var(--muted);font-size:13px}
button#theme{background:var(--panel);color:var(--fg);border:1px solid var(--border);border-radius:8px;
 padding:6px 12px;font:inherit;font-size:12px;cursor:pointer}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:10px;margin-bottom:14px}
.card{background:var(--panel);border:1px solid var(--border);border-radius:10px;padding:10px 12px;
 box-shadow:var(--shadow)}
.card .k{color:var(--muted);font-size:11px;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:19px;font-weight:640;margin-top:2px;font-variant-numeric:tabular-nums}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:14px}
.chart{background:var(--panel);border:1px solid var(--border);border-radius:10px;padding:12px 14px 8px;
 box-shadow:var(--shadow);position:relative;min-width:0}
.chart h2{font-size:14px;margin:0;font-weight:620}
.chart .note{color:var(--muted);font-size:12px;margin:1px 0 4px}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px;color:var(--muted);margin:4px 0 2px}
.legend span{display:inline-flex;align-items:center;gap:5px}
.legend i{display:inline-block;width:14px;height:3px;border-radius:2px}
.legend i.dot{width:8px;height:8px;border-radius:50%}
svg{display:block;width:100%;height:auto;overflow:visible}
svg text{fill:var(--muted);font-size:11px;font-variant-numeric:tabular-nums}
.gridline{stroke:var(--grid);stroke-width:1}
.axisline{stroke:var(--axis);stroke-width:1}
.epochline{stroke:var(--epoch);stroke-width:1;stroke-dasharray:3 4;opacity:.8}
svg text.epochlabel{fill:var(--epoch);font-size:10px}
.eventline{stroke:var(--event);stroke-width:1.6;stroke-dasharray:6 3}
svg text.eventlabel{fill:var(--event);font-size:10.5px;font-weight:620}
.tip .event{color:var(--event);font-weight:620}
.empty{fill:var(--muted);font-size:13px}
.hover line{stroke:var(--axis);stroke-width:1}
.tip{position:fixed;pointer-events:none;background:var(--panel);color:var(--fg);border:1px solid var(--border);
 border-radius:8px;padding:6px 9px;font-size:12px;box-shadow:0 4px 14px rgba(0,0,0,.18);z-index:9;white-space:nowrap}
.tip b{font-weight:620}
.tip .row{display:flex;align-items:center;gap:6px}
.tip i{display:inline-block;width:8px;height:8px;border-radius:50%}
.tables{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:14px;margin-top:14px}
details,.tablebox{background:var(--panel);border:1px solid var(--border);border-radius:10px;padding:10px 14px;
 box-shadow:var(--shadow)}
summary{cursor:pointer;font-weight:620}
.tablebox h2{font-size:14px;margin:0 0 6px;font-weight:620}
table{border-collapse:collapse;width:100%;font-size:12.5px;font-variant-numeric:tabular-nums}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid var(--grid)}
th{color:var(--muted);font-weight:560}
td.num,th.num{text-align:right}
footer{color:var(--muted);font-size:12px;margin-top:16px}
"""
)

_JS = r"""
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("elche-data").textContent);
  var NS = "http://www.w3.org/2000/svg";
  var PALETTE = ["#3b82f6", "#f97316", "#10b981", "#e11d48", "#8b5cf6", "#0ea5e9", "#ca8a04", "#14b8a6",
                 "#db2777", "#65a30d"];
  var W = 640, H = 250, M = {l: 58, r: 14, t: 20, b: 30};
  var syncs = DATA.syncs || [], evals = DATA.evals || [], epochs = DATA.epochs || [];
  var events = (DATA.events || []).filter(function (e) { return typeof e.t === "number" && isFinite(e.t); });
  var meta = DATA.meta || {}, world = meta.world_size || 1;
  // Per-rank series follow the launch numbers (a sync's "ranks"), which renumbering after a loss keeps.
  var launchRanks = [];
  function addRank(k) { if (launchRanks.indexOf(k) < 0) launchRanks.push(k); }
  (meta.ranks || []).forEach(addRank);
  syncs.forEach(function (r) { (r.ranks || []).forEach(addRank); });
  if (!launchRanks.length) for (var k0 = 0; k0 < world; k0++) launchRanks.push(k0);
  launchRanks.sort(function (a, b) { return a - b; });
  var tEnd = Math.max(DATA.t_end || 0, syncs.length ? syncs[syncs.length - 1].t : 0,
                      evals.length ? evals[evals.length - 1].t : 0, 1e-3);
  var totalPoints = 0, chartCount = 0;

  function rankColor(k) { return k < PALETTE.length ? PALETTE[k] : "hsl(" + ((k * 137.5) % 360) + ",62%,52%)"; }
  function svg(tag, attrs, parent) {
    var e = document.createElementNS(NS, tag);
    for (var a in attrs) {
      // CSS variables only resolve in style properties, not in presentation attributes.
      if ((a === "stroke" || a === "fill") && String(attrs[a]).indexOf("var(") === 0) e.style[a] = attrs[a];
      else e.setAttribute(a, attrs[a]);
    }
    if (parent) parent.appendChild(e);
    return e;
  }
  function node(tag, cls, text, parent) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function finite(v) { return typeof v === "number" && isFinite(v); }
  function fmtTime(s, step) {
    if (!finite(s)) return "–";
    if (s < 60) {
      var d = step ? Math.max(0, Math.min(3, -Math.floor(Math.log10(step) + 1e-9))) : (s < 10 ? 1 : 0);
      return s.toFixed(d) + " s";
    }
    var m = Math.floor(s / 60), r = Math.round(s - 60 * m);
    if (m < 60) return m + " min" + (r ? " " + r + " s" : "");
    var hh = Math.floor(m / 60);
    return hh + " h " + (m % 60) + " min";
  }
  function fmtNum(v) {
    if (!finite(v)) return "–";
    var a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e6 || a < 1e-3) return v.toExponential(2);
    if (a >= 1000) return v.toFixed(0).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    if (a >= 100) return v.toFixed(1);
    if (a >= 10) return v.toFixed(2);
    return v.toPrecision(3);
  }
  function fmtInt(v) { return finite(v) ? Math.round(v).toString().replace(/\B(?=(\d{3})+(?!\d))/g, ",") : "–"; }
  function fmtTick(v, step) {
    var a = Math.abs(v);
    if (a >= 1e6 || (a > 0 && step < 1e-4)) return v.toExponential(1);
    var decimals = Math.max(0, Math.min(6, -Math.floor(Math.log10(step) + 1e-9)));
    return decimals ? v.toFixed(decimals) : fmtInt(v);
  }
  function fmtLog(v) {  // a tick at log10 value v: 1, 2 or 5 times a power of ten
    var dec = Math.floor(v + 1e-9), f = Math.round(Math.pow(10, v - dec));
    if (dec >= 0) return fmtInt(f * Math.pow(10, dec));
    return dec >= -5 ? (f * Math.pow(10, dec)).toFixed(-dec) : f + "e" + dec;
  }
  function niceStep(span, n) {
    var raw = span / Math.max(1, n), p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
  }
  // Time ticks on round minutes and hours once the run is long enough.
  function timeStep(span, n) {
    var raw = span / n, steps = [60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
    if (raw < 45) return niceStep(span, n);
    for (var i = 0; i < steps.length; i++) if (steps[i] >= raw) return steps[i];
    return niceStep(span, n);
  }
  function ticks(lo, hi, n, fixed) {
    var step = fixed || niceStep(hi - lo, n), out = [];
    for (var v = Math.ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) {
      out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    }
    return out;
  }

  // One chart: spec = {title, note, series: [{name, color, pts: [[x, y]], kind, width, dash, opacity}],
  //                    zero, yMax, log, yFmt}
  function chart(spec) {
    var box = node("section", "chart", null, document.getElementById("charts"));
    box.setAttribute("data-chart", spec.id || spec.title);
    node("h2", null, spec.title, box);
    if (spec.note) node("div", "note", spec.note, box);
    var legend = node("div", "legend", null, box);
    var s = svg("svg", {viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": spec.title}, box);
    var series = spec.series.filter(function (x) { return x.pts.length > 0; });
    var points = 0, ys = [];
    series.forEach(function (x) {
      points += x.pts.length;
      x.pts.forEach(function (p) { if (finite(p[1]) && (!spec.log || p[1] > 0)) ys.push(p[1]); });
      var item = node("span", null, null, legend);
      var sw = node("i", x.kind === "dots" ? "dot" : null, null, item);
      sw.style.background = x.color;
      if (x.dash) sw.style.opacity = 0.7;
      node("span", null, x.name, item);
    });
    s.setAttribute("data-points", String(points));
    s.setAttribute("data-series", String(series.length));
    totalPoints += points;
    chartCount += 1;
    var pw = W - M.l - M.r, ph = H - M.t - M.b;
    var x0 = 0, x1 = tEnd;
    var sx = function (x) { return M.l + (x - x0) / (x1 - x0) * pw; };
    if (!ys.length) {
      svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle", "class": "empty"}, s).textContent =
        spec.empty || "no data recorded";
      return box;
    }
    var lo = Math.min.apply(null, ys), hi = Math.max.apply(null, ys);
    var log = spec.log === true || (spec.log === "auto" && lo > 0 && hi / lo > 30);
    if (log) { lo = Math.log10(lo); hi = Math.log10(hi); }
    else {
      if (spec.zero) lo = Math.min(0, lo);
      if (spec.yMax !== undefined) hi = Math.max(hi, spec.yMax);
    }
    if (hi - lo < 1e-12) { var pad = Math.abs(hi) * 0.1 || 1; lo -= pad; hi += pad; }
    else if (!(spec.zero && lo === 0)) { var m = (hi - lo) * 0.06; lo -= m; hi += m; }
    else hi += (hi - lo) * 0.04;
    var ty = function (v) { return log ? Math.log10(v) : v; };
    var sy = function (v) { return M.t + (1 - (ty(v) - lo) / (hi - lo)) * ph; };
    // grid and axes
    var g = svg("g", {}, s);
    var yt = ticks(lo, hi, 5), yStep = niceStep(hi - lo, 5);
    if (log) {  // decades; 1-2-5 within each decade when the range spans few of them
      var mult = hi - lo <= 2.5 ? [1, 2, 5] : [1];
      yt = [];
      for (var dec = Math.floor(lo); dec <= Math.ceil(hi); dec++) {
        mult.forEach(function (f) { var v = dec + Math.log10(f); if (v >= lo - 1e-9 && v <= hi + 1e-9) yt.push(v); });
      }
    }
    yt.forEach(function (v) {
      var y = M.t + (1 - (v - lo) / (hi - lo)) * ph;
      svg("line", {x1: M.l, x2: W - M.r, y1: y, y2: y, "class": "gridline"}, g);
      svg("text", {x: M.l - 7, y: y + 3.5, "text-anchor": "end"}, g).textContent =
        log ? fmtLog(v) : fmtTick(v, yStep);
    });
    var xStep = timeStep(x1 - x0, 7);
    ticks(x0, x1, 7, xStep).forEach(function (v) {
      var x = sx(v);
      if (x > W - M.r + 0.5) return;
      svg("line", {x1: x, x2: x, y1: H - M.b, y2: H - M.b + 4, "class": "axisline"}, g);
      svg("text", {x: x, y: H - M.b + 16, "text-anchor": "middle"}, g).textContent = fmtTime(v, xStep);
    });
    svg("line", {x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b, "class": "axisline"}, g);
    // epoch boundaries
    epochs.forEach(function (e, i) {
      if (i === epochs.length - 1 || !finite(e.end)) return;  // a boundary needs a next epoch
      var x = sx(e.end);
      svg("line", {x1: x, x2: x, y1: M.t - 8, y2: H - M.b, "class": "epochline"}, g);
      if (epochs.length <= 24 || (e.epoch + 1) % Math.ceil(epochs.length / 24) === 0) {
        svg("text", {x: x + 3, y: M.t - 2, "class": "epochlabel"}, g).textContent = "ep " + (e.epoch + 1);
      }
    });
    // events (lost ranks): a marker on the time axis, its label names them, its title gives the reasons
    events.forEach(function (e) {
      var x = sx(e.t);
      var mark = svg("g", {"class": "event", "data-event": e.label, "data-t": String(e.t)}, g);
      svg("title", {}, mark).textContent = eventText(e);
      svg("line", {x1: x, x2: x, y1: M.t - 8, y2: H - M.b + 4, "class": "eventline"}, mark);
      var right = x > W - M.r - 90;
      svg("text", {x: right ? x - 4 : x + 4, y: M.t + 8, "class": "eventlabel", "text-anchor": right ? "end" : "start"},
          mark).textContent = e.text || e.label;
    });
    s.setAttribute("data-events", String(events.length));
    // series
    var clip = "clip" + chartCount;
    var defs = svg("defs", {}, s);
    var cp = svg("clipPath", {id: clip}, defs);
    svg("rect", {x: M.l, y: M.t - 2, width: pw, height: ph + 4}, cp);
    var layer = svg("g", {"clip-path": "url(#" + clip + ")"}, s);
    series.forEach(function (x) {
      var pts = x.pts.filter(function (p) { return finite(p[1]) && (!log || p[1] > 0); });
      if (x.kind === "dots") {
        pts.forEach(function (p) {
          svg("circle", {cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: x.r || 3.2, fill: x.color,
                         "fill-opacity": x.opacity || 1}, layer);
        });
        if (x.connect && pts.length > 1) {
          var dd = pts.map(function (p, i) {
            return (i ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1);
          });
          svg("path", {d: dd.join(""), fill: "none", stroke: x.color, "stroke-width": 1.5, "stroke-opacity": 0.55},
              layer);
        }
        return;
      }
      if (x.kind === "bars") {
        var base = sy(log ? Math.pow(10, lo) : Math.max(lo, 0));
        var d = pts.map(function (p) {
          var px = sx(p[0]).toFixed(1);
          return "M" + px + " " + base.toFixed(1) + "V" + sy(p[1]).toFixed(1);
        });
        // Bars thin out as syncs get denser, so that neighbours stay apart.
        var width = Math.max(0.5, Math.min(x.width || 2, 0.55 * pw / Math.max(1, pts.length)));
        svg("path", {d: d.join(""), stroke: x.color, "stroke-width": width.toFixed(2),
                     "stroke-opacity": x.opacity || 0.85, fill: "none", "data-n": pts.length}, layer);
        return;
      }
      var parts = [];
      pts.forEach(function (p, i) {
        var px = sx(p[0]).toFixed(1), py = sy(p[1]).toFixed(1);
        if (!i) parts.push("M" + px + " " + py);
        else if (x.kind === "step") parts.push("H" + px + "V" + py);
        else parts.push("L" + px + " " + py);
      });
      if (x.kind === "step" && pts.length) parts.push("H" + sx(tEnd).toFixed(1));
      var attrs = {d: parts.join(""), fill: "none", stroke: x.color, "stroke-width": x.width || 1.8,
                   "stroke-linejoin": "round", "stroke-linecap": "round", "stroke-opacity": x.opacity || 1,
                   "data-n": pts.length};
      if (x.dash) attrs["stroke-dasharray"] = x.dash;
      svg("path", attrs, layer);
      if (pts.length === 1) svg("circle", {cx: sx(pts[0][0]), cy: sy(pts[0][1]), r: 3, fill: x.color}, layer);
    });
    hover(s, series, sx, sy, log);
    return box;
  }

  function nearest(pts, x) {
    var a = 0, b = pts.length - 1;
    if (b < 0) return null;
    while (b - a > 1) { var m = (a + b) >> 1; if (pts[m][0] < x) a = m; else b = m; }
    return Math.abs(pts[a][0] - x) <= Math.abs(pts[b][0] - x) ? pts[a] : pts[b];
  }
  function hover(s, series, sx, sy, log) {
    var tip = document.getElementById("tip");
    var hg = svg("g", {"class": "hover", visibility: "hidden"}, s);
    var vline = svg("line", {y1: M.t, y2: H - M.b}, hg);
    var dots = series.map(function (x) {
      return svg("circle", {r: 3.6, fill: x.color, stroke: "var(--panel)", "stroke-width": 1.5}, hg);
    });
    var hit = svg("rect", {x: M.l, y: M.t, width: W - M.l - M.r, height: H - M.t - M.b, fill: "transparent"}, s);
    hit.addEventListener("mousemove", function (ev) {
      var r = s.getBoundingClientRect(), t = (ev.clientX - r.left) / r.width * W;
      var x = (t - M.l) / (W - M.l - M.r) * tEnd;
      var rows = [], near = null;
      series.forEach(function (ser, i) {
        var p = nearest(ser.pts, x);
        if (!p || !finite(p[1]) || (log && p[1] <= 0)) { dots[i].setAttribute("visibility", "hidden"); return; }
        dots[i].setAttribute("visibility", "visible");
        dots[i].setAttribute("cx", sx(p[0])); dots[i].setAttribute("cy", sy(p[1]));
        if (near === null || Math.abs(p[0] - x) < Math.abs(near - x)) near = p[0];
        rows.push('<div class="row"><i style="background:' + ser.color + '"></i>' + esc(ser.name) + ": <b>" +
                  fmtNum(p[1]) + "</b></div>");
      });
      var close = events.filter(function (e) { return Math.abs(sx(e.t) - t) <= 6; });
      if (near === null && !close.length) return;
      if (near === null) near = close[0].t;
      vline.setAttribute("x1", sx(near)); vline.setAttribute("x2", sx(near));
      hg.setAttribute("visibility", "visible");
      close.forEach(function (e) { rows.unshift('<div class="event">' + esc(eventText(e)) + "</div>"); });
      tip.innerHTML = "<div>" + fmtTime(near) + "</div>" + rows.join("");
      tip.hidden = false;
      var left = ev.clientX + 14, top = ev.clientY + 12;
      if (left + tip.offsetWidth > window.innerWidth - 8) left = ev.clientX - tip.offsetWidth - 14;
      tip.style.left = left + "px"; tip.style.top = top + "px";
    });
    hit.addEventListener("mouseleave", function () { hg.setAttribute("visibility", "hidden"); tip.hidden = true; });
  }
  function eventText(e) {
    var parts = [(e.text || e.label) + " at " + fmtTime(e.t)];
    if (finite(e.sync)) parts.push("sync " + e.sync);
    if (finite(e.epoch)) parts.push("epoch " + e.epoch);
    var why = Object.keys(e.reasons || {}).map(function (r) { return "rank " + r + ": " + e.reasons[r]; });
    var line = parts.join(", ");
    if (why.length) line += " (" + why.join("; ") + ")";
    if (finite(e.survivors)) line += "; " + e.survivors + " rank" + (e.survivors === 1 ? "" : "s") + " go on";
    return line;
  }
  var ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"};
  function esc(t) { return String(t).replace(/[&<>"]/g, function (c) { return ENTITIES[c]; }); }
  function addKeys(list, obj) {
    Object.keys(obj || {}).forEach(function (k) { if (list.indexOf(k) < 0) list.push(k); });
  }

  // ---- series from records ----
  function col(key) {
    return syncs.filter(function (r) { return finite(r[key]); }).map(function (r) { return [r.t, r[key]]; });
  }
  function row(r, k) { return r.ranks ? r.ranks.indexOf(k) : k; }  // k: a launch number
  function rankCol(key, k) {
    return syncs.filter(function (r) { return r.per_rank && r.per_rank[key] && finite(r.per_rank[key][row(r, k)]); })
      .map(function (r) { return [r.t, r.per_rank[key][row(r, k)]]; });
  }
  var lostRanks = [];
  events.forEach(function (e) { (e.lost || []).forEach(function (k) { lostRanks.push(k); }); });
  function rankSeries(key, opts) {
    var out = [];
    launchRanks.forEach(function (k) {
      var lost = lostRanks.indexOf(k) >= 0;
      var s = {name: "rank " + k + (lost ? " (lost)" : ""), color: rankColor(k), pts: rankCol(key, k)};
      for (var o in opts || {}) s[o] = opts[o];
      out.push(s);
    });
    return out;
  }
  var evalKeys = [];
  evals.forEach(function (e) { addKeys(evalKeys, e.metrics); });
  function evalCol(key) {
    return evals.filter(function (e) { return e.metrics && finite(e.metrics[key]); })
      .map(function (e) { return [e.t, e.metrics[key]]; });
  }
  var EVAL_COLORS = ["#d946ef", "#0891b2", "#ea580c", "#16a34a", "#9333ea", "#be123c"];

  // ---- header and cards ----
  var last = syncs.length ? syncs[syncs.length - 1] : null;
  var cfg = meta.config || {};
  document.getElementById("subtitle").textContent = [
    "mode " + (cfg.mode || "?"), world + (world === 1 ? " rank" : " ranks") +
      (lostRanks.length ? " (" + lostRanks.length + " lost)" : ""),
    meta.started ? "started " + meta.started : null,
    meta.versions ? "lightning-elche " + meta.versions.lightning_elche : null
  ].filter(Boolean).join(" · ");
  var cards = document.getElementById("cards");
  function card(k, v) { var c = node("div", "card", null, cards); node("div", "k", k, c); node("div", "v", v, c); }
  card("wall time", fmtTime(tEnd));
  card("epochs", String(epochs.filter(function (e) { return finite(e.end); }).length));
  card("syncs", last ? fmtInt(last.sync) : "0");
  card("cohort steps", last ? fmtInt(last.cohort_step) : "0");
  var lossPts = col("loss");
  card("train loss", lossPts.length ? fmtNum(lossPts[lossPts.length - 1][1]) : "–");
  var valLossKey = evalKeys.filter(function (k) { return /loss/i.test(k); })[0];
  if (valLossKey) {
    var vl = evalCol(valLossKey).map(function (p) { return p[1]; });
    card("best " + valLossKey, vl.length ? fmtNum(Math.min.apply(null, vl)) : "–");
  }
  card("anchor", last ? String(last.anchor) : "–");
  if (lostRanks.length) {
    card("ranks lost", lostRanks.length + " (rank" + (lostRanks.length > 1 ? "s " : " ") + lostRanks.join(", ") + ")");
  }
  var rate = col("samples_per_s");
  card("samples/s", rate.length ? fmtNum(rate[rate.length - 1][1]) : "–");

  // ---- charts ----
  var lossSeries = [{name: "train loss (all ranks, work-weighted)", color: "var(--total)", pts: lossPts, width: 2.2}];
  lossSeries = lossSeries.concat(rankSeries("loss", {width: 1.1, opacity: 0.55}).map(function (s) {
    s.name = s.name + " window loss"; return s; }));
  evalKeys.filter(function (k) { return /loss/i.test(k); }).forEach(function (k, i) {
    lossSeries.push({name: k + " (validation)", color: EVAL_COLORS[i % EVAL_COLORS.length], pts: evalCol(k),
                     kind: "dots", connect: true, r: 3.6});
  });
  chart({id: "loss", title: "Loss", note: "training loss per sync window and validation loss, vs wall time",
         series: lossSeries, log: "auto"});
  chart({id: "validation", title: "Validation metrics", note: "logged during validation, per epoch",
         series: evalKeys.map(function (k, i) {
           return {name: k, color: EVAL_COLORS[i % EVAL_COLORS.length], pts: evalCol(k), kind: "dots", connect: true,
                   r: 3.6};
         }), empty: "no validation metrics recorded"});
  chart({id: "batch_share", title: "Batch share per rank",
         note: "fraction of the cohort's steps taken by each rank in each window",
         series: rankSeries("batch_share", {}), zero: true, yMax: 1 / Math.max(world, 1) * 1.2});
  var rateSeries = rankSeries("samples_per_s", {});
  if (world > 1) rateSeries.push({name: "all ranks", color: "var(--total)", pts: rate, dash: "5 4", width: 1.6});
  chart({id: "samples_per_s", title: "Throughput (samples/s)", note: "per rank over its compute time; dashed: the sum",
         series: rateSeries, zero: true});
  var anchorSeries = [{name: "anchor (steps per window of the slowest rank)", color: "var(--accent)",
                       pts: col("anchor"), kind: "step", width: 2}];
  chart({id: "anchor", title: "Anchor", note: "window size of the slowest rank; grows while syncs cost too much",
         series: anchorSeries, zero: true});
  var div = col("divergence");
  if (div.length) {
    chart({id: "divergence", title: "Divergence", note: "replica divergence measured at syncs",
           series: [{name: "divergence", color: "#e11d48", pts: div}], zero: true});
  }
  chart({id: "syncs", title: "Sync events",
         note: "one bar per sync: cohort steps in the window; dashed lines: epoch ends",
         series: [{name: "cohort steps per window", color: "var(--accent)", pts: col("window_steps"), kind: "bars",
                   width: 2.2}],
         zero: true});
  var reductions = meta.scalar_reductions || {};
  var userKeys = [];
  var scalarRecords = DATA.scalars || [];
  scalarRecords.forEach(function (r) { addKeys(userKeys, r.values); });
  userKeys.forEach(function (k) {
    var how = reductions[k] || meta.default_reduction || "mean";
    var rolled = scalarRecords.filter(function (r) { return r.values && finite(r.values[k]) && finite(r.t); })
      .map(function (r) { return [r.t, r.values[k]]; });
    var ser = [{name: k + " (" + how + " over ranks)", color: "var(--total)", pts: rolled, width: 2}];
    chart({id: "scalar:" + k, title: k, note: "user scalar at syncs, rolled up across ranks by " + how, series: ser,
           log: /loss/i.test(k) ? "auto" : false});
  });

  // ---- tables ----
  var tables = document.getElementById("tables");
  var lossEvents = events.filter(function (e) { return e.label === "rank_lost"; });
  if (lossEvents.length) {
    var lb = node("div", "tablebox", null, tables);
    node("h2", null, "Lost ranks", lb);
    var lt = node("table", null, null, lb), lh = node("tr", null, null, node("thead", null, null, lt));
    ["time", "sync", "epoch", "lost (launch rank)", "reason", "going on"].forEach(function (c) {
      node("th", null, c, lh);
    });
    var lbody = node("tbody", null, null, lt);
    lossEvents.forEach(function (e) {
      var tr = node("tr", null, null, lbody);
      [fmtTime(e.t), finite(e.sync) ? String(e.sync) : "–", finite(e.epoch) ? String(e.epoch) : "–",
       (e.lost || []).join(", "),
       Object.keys(e.reasons || {}).map(function (r) { return r + ": " + e.reasons[r]; }).join("; ") || "–",
       finite(e.survivors) ? String(e.survivors) : "–"].forEach(function (v) { node("td", null, v, tr); });
    });
  }
  if ((DATA.ranks || []).length) {
    var tb = node("div", "tablebox", null, tables);
    node("h2", null, "Per rank", tb);
    var t = node("table", null, null, tb), hr = node("tr", null, null, node("thead", null, null, t));
    ["rank", "steps", "share", "samples", "samples/s", "idle"].forEach(function (c, i) {
      node("th", i ? "num" : null, c, hr);
    });
    var body = node("tbody", null, null, t), tot = 0;
    DATA.ranks.forEach(function (r) { tot += r.steps || 0; });
    DATA.ranks.forEach(function (r) {
      var tr = node("tr", null, null, body);
      var sw = node("td", null, null, tr), i = node("i", null, null, sw);
      var launch = finite(r.original_rank) ? r.original_rank : r.rank;
      i.style.cssText = "display:inline-block;width:9px;height:9px;border-radius:50%;margin-right:6px;background:" +
        rankColor(launch);
      // A renumbered survivor shows its launch number too; a lost rank is marked lost.
      var name = r.lost ? launch + " (lost)" : (launch !== r.rank ? r.rank + " (was " + launch + ")" : String(r.rank));
      sw.appendChild(document.createTextNode(name));
      var busy = (r.compute_s || 0) + (r.sync_s || 0);
      [fmtInt(r.steps), tot ? (100 * r.steps / tot).toFixed(1) + "%" : "–", fmtInt(r.samples),
       r.compute_s > 0 ? fmtNum(r.samples / r.compute_s) : "–",
       busy > 0 ? (100 * r.sync_s / busy).toFixed(1) + "%" : "–"]
        .forEach(function (v) { node("td", "num", v, tr); });
    });
  }
  var det = node("details", null, null, tables);
  node("summary", null, "Configuration", det);
  var ct = node("table", null, null, det), cb = node("tbody", null, null, ct);
  Object.keys(cfg).forEach(function (k) {
    var tr = node("tr", null, null, cb); node("td", null, k, tr);
    var v = cfg[k];
    node("td", null, v === null ? "–" : (typeof v === "object" ? JSON.stringify(v) : String(v)), tr);
  });
  var red = Object.keys(reductions);
  var tr2 = node("tr", null, null, cb); node("td", null, "scalar_reductions", tr2);
  node("td", null, red.length ? red.map(function (k) { return k + ": " + reductions[k]; }).join(", ")
                              : "(none declared; user scalars use mean)", tr2);

  var dropped = (DATA.dropped || 0);
  var clockRank = finite(meta.root_original_rank) ? meta.root_original_rank : 0;
  document.getElementById("footer").textContent = "Written by lightning_elche.ElCheMonitor at the end of fit. " +
    "Times are seconds since training started (" + (clockRank ? "the clock of launch rank " + clockRank +
      ", rank 0 after the loss of rank 0)." : "rank 0's clock).") +
    (dropped ? " The oldest " + dropped + " records were dropped by the size cap." : "") +
    " This page is self-contained: it loads nothing from the network.";

  // ---- theme toggle ----
  var btn = document.getElementById("theme"), root = document.documentElement;
  function label() { btn.textContent = "theme: " + (root.getAttribute("data-theme") || "auto"); }
  btn.addEventListener("click", function () {
    var cur = root.getAttribute("data-theme") || "auto", next = {auto: "light", light: "dark", dark: "auto"}[cur];
    if (next === "auto") root.removeAttribute("data-theme"); else root.setAttribute("data-theme", next);
    label();
  });
  label();

  // Where each plot area landed (CSS pixels, page coordinates), for screenshot checks.
  Array.prototype.forEach.call(document.querySelectorAll("section.chart"), function (c) {
    var r = c.querySelector("svg").getBoundingClientRect(), k = r.width / W;
    var box = [r.left + window.scrollX + M.l * k, r.top + window.scrollY + M.t * k, (W - M.l - M.r) * k,
               (H - M.t - M.b) * k];
    c.setAttribute("data-plot", box.map(Math.round).join(","));
  });
  document.body.setAttribute("data-charts", String(chartCount));
  document.body.setAttribute("data-points", String(totalPoints));
  document.body.setAttribute("data-ready", "1");
})();
"""
