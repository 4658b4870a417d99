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
    if (finite(e.world_size)) line += "; " + e.world_size + " rank" + (e.world_size === 1 ? "" : "s") + " from then on";
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
  var lostRanks = [], joinedRanks = [];
  events.forEach(function (e) {
    (e.lost || []).forEach(function (k) { lostRanks.push(k); });
    (e.joined || []).forEach(function (k) { joinedRanks.push(k); });
  });
  function rankSeries(key, opts) {
    var out = [];
    launchRanks.forEach(function (k) {
      var lost = lostRanks.indexOf(k) >= 0, joined = joinedRanks.indexOf(k) >= 0;
      var s = {name: "rank " + k + (joined ? " (joined)" : "") + (lost ? " (lost)" : ""), color: rankColor(k),
               pts: rankCol(key, k)};
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
      (lostRanks.length ? " (" + lostRanks.length + " lost)" : "") +
      (joinedRanks.length ? " (" + joinedRanks.length + " joined)" : ""),
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
  if (joinedRanks.length) {
    card("ranks joined", joinedRanks.length + " (rank" + (joinedRanks.length > 1 ? "s " : " ") + joinedRanks.join(", ") +
         ")");
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
  var joinEvents = events.filter(function (e) { return e.label === "rank_joined"; });
  if (joinEvents.length) {
    var jb = node("div", "tablebox", null, tables);
    node("h2", null, "Joined ranks", jb);
    var jt = node("table", null, null, jb), jh = node("tr", null, null, node("thead", null, null, jt));
    ["time", "sync", "epoch", "joined (member id)", "ranks after"].forEach(function (c) { node("th", null, c, jh); });
    var jbody = node("tbody", null, null, jt);
    joinEvents.forEach(function (e) {
      var tr = node("tr", null, null, jbody);
      [fmtTime(e.t), finite(e.sync) ? String(e.sync) : "–", finite(e.epoch) ? String(e.epoch) : "–",
       (e.joined || []).join(", "), finite(e.world_size) ? String(e.world_size) : "–"]
        .forEach(function (v) { node("td", null, v, tr); });
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
      var name = r.lost ? launch + " (lost)" :
        r.joined ? r.rank + " (joined" + (launch !== r.rank ? " as " + launch : "") + ")" :
        (launch !== r.rank ? r.rank + " (was " + launch + ")" : String(r.rank));
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
