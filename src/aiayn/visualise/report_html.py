"""A self-contained interactive HTML report of a sentence's attention (no network at view time).

One file: the weights as inline JSON, inline CSS and JavaScript. Choose the attention kind (encoder,
decoder, cross) and the layer; every head of that layer is drawn as a heatmap with the key tokens under
it. Hover (or click, to pin) a query token in the strip at the top, or a row of any heatmap, and each head
colours the keys by how much that token attends to them; hovering a cell shows the exact weight.

The page writes its state into ``#status`` (``data-state="ok"`` and ``data-heads`` = heads drawn, or
``data-state="error"`` with the message), and with the URL fragment ``#selftest`` it draws every kind and
layer in turn and checks the hover colouring, so a headless browser's DOM dump shows whether it works.
``#query=N`` pins query token N on load (for screenshots).

Legend: L layers, H heads, T query length, S key length.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Sequence

from aiayn.visualise.collect import AttentionView
from aiayn.visualise.files import atomic_write_text


def report_data(views: Sequence[AttentionView], labels: dict[tuple[str, int, int], str] | None = None,
                digits: int = 4) -> dict:
    """The JSON the page reads: per view its tokens, weights (L, H, T, S) rounded, and head labels."""
    labels = labels or {}
    sections = []
    for view in views:
        layers, heads = view.weights.shape[:2]
        sections.append({
            "kind": view.kind, "title": view.title, "causal": view.causal,
            "layers": layers, "heads": heads,
            "queries": view.query_tokens, "keys": view.key_tokens,
            "weights": [[[[round(float(w), digits) for w in row] for row in head]
                         for head in layer] for layer in view.weights.tolist()],
            "labels": [[labels.get((view.kind, layer, head), "") for head in range(heads)]
                       for layer in range(layers)],
        })
    return {"sections": sections}


def write_attention_html(views: Sequence[AttentionView], path: str | Path, *, title: str,
                         labels: dict[tuple[str, int, int], str] | None = None) -> Path:
    """Write the interactive report for ``views`` (one sentence) to ``path`` atomically.

    Args:
        views: the attention kinds to show (from ``views_of``).
        path: the ``.html`` file.
        title: page title (escaped).
        labels: optional pattern label per (kind, layer, head).

    Raises:
        ValueError: no views.
    """
    if not views:
        raise ValueError("no attention to report")
    payload = json.dumps(report_data(views, labels), ensure_ascii=False, separators=(",", ":"))
    # Inside <script> only "</" can end the element early; "<\/" is the same JSON string.
    payload = payload.replace("</", "<\\/")
    page = (PAGE.replace("__TITLE__", html.escape(title))
                .replace("__DATA__", payload))
    atomic_write_text(path, page)
    return Path(path)


PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
body { font-family: system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 20px; margin: 0 0 8px 0; }
.bar { margin: 6px 0; display: flex; flex-wrap: wrap; gap: 4px; align-items: center; }
.bar b { margin-right: 6px; }
button { border: 1px solid #999; background: #f4f4f4; padding: 3px 9px; cursor: pointer; border-radius: 3px; }
button.on { background: #2c5ea8; color: white; border-color: #2c5ea8; }
.tok { display: inline-block; padding: 1px 4px; margin: 1px; border-radius: 3px; font-family: ui-monospace, monospace; font-size: 12px; white-space: pre; }
#queries .tok { cursor: pointer; border: 1px solid #ccc; }
#queries .tok.sel { border-color: #d33; background: #fde; }
#heads { display: flex; flex-wrap: wrap; gap: 14px; margin-top: 10px; }
.head { border: 1px solid #ddd; border-radius: 4px; padding: 6px; max-width: 340px; }
.head h3 { font-size: 13px; margin: 0 0 4px 0; font-weight: 600; }
.head canvas { image-rendering: pixelated; border: 1px solid #eee; cursor: crosshair; }
.head .keys { margin-top: 4px; line-height: 1.6; }
.head .info { font-size: 11px; color: #555; min-height: 14px; }
#status { margin-top: 12px; font-size: 12px; color: #555; }
.note { font-size: 12px; color: #555; }
</style>
</head>
<body>
<h1>__TITLE__</h1>
<div class="note">Rows of each heatmap are queries (the attending tokens), columns are keys. Hover or click a query token (or a heatmap row) to colour the keys each head attends to.</div>
<div class="bar" id="kinds"><b>attention</b></div>
<div class="bar" id="layers"><b>layer</b></div>
<div class="bar" id="queries"><b>query</b></div>
<div id="heads"></div>
<div id="status" data-state="loading">loading</div>
<script id="attention-data" type="application/json">__DATA__</script>
<script>
"use strict";
const statusBox = document.getElementById("status");
function fail(message) {
  statusBox.dataset.state = "error";
  statusBox.textContent = "error: " + message;
}
window.addEventListener("error", function (event) { fail(event.message); });
const DATA = JSON.parse(document.getElementById("attention-data").textContent);
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function colour(t) {
  t = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(t), VIRIDIS.length - 2), f = t - i;
  const c = VIRIDIS[i].map(function (v, k) { return Math.round(v + f * (VIRIDIS[i + 1][k] - v)); });
  return "rgb(" + c.join(",") + ")";
}
const state = { section: 0, layer: 0, query: null, pinned: false };
function button(parent, text, on, handler) {
  const b = document.createElement("button");
  b.textContent = text;
  if (on) b.className = "on";
  b.addEventListener("click", handler);
  parent.appendChild(b);
  return b;
}
function clearBar(id) {
  const bar = document.getElementById(id);
  while (bar.children.length > 1) bar.removeChild(bar.lastChild);
  return bar;
}
function render() {
  const section = DATA.sections[state.section];
  const kinds = clearBar("kinds");
  DATA.sections.forEach(function (s, i) {
    button(kinds, s.title, i === state.section, function () { select(i, 0); });
  });
  const layers = clearBar("layers");
  for (let l = 0; l < section.layers; l++) {
    button(layers, String(l), l === state.layer, function () { select(state.section, l); });
  }
  const queries = clearBar("queries");
  section.queries.forEach(function (token, i) {
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = token;
    span.dataset.index = i;
    span.addEventListener("mouseover", function () { if (!state.pinned) setQuery(i); });
    span.addEventListener("click", function () { state.pinned = !(state.pinned && state.query === i); setQuery(i); });
    queries.appendChild(span);
  });
  const heads = document.getElementById("heads");
  heads.innerHTML = "";
  const T = section.queries.length, S = section.keys.length;
  const cell = Math.max(4, Math.min(22, Math.floor(320 / Math.max(T, S))));
  for (let h = 0; h < section.heads; h++) {
    const weights = section.weights[state.layer][h];
    const panel = document.createElement("div");
    panel.className = "head";
    panel.dataset.head = h;
    const title = document.createElement("h3");
    const label = section.labels[state.layer][h];
    title.textContent = "layer " + state.layer + " head " + h + (label ? " \u00b7 " + label : "");
    panel.appendChild(title);
    const canvas = document.createElement("canvas");
    canvas.width = S * cell; canvas.height = T * cell;
    panel.appendChild(canvas);
    const info = document.createElement("div");
    info.className = "info";
    panel.appendChild(info);
    const keys = document.createElement("div");
    keys.className = "keys";
    section.keys.forEach(function (token) {
      const span = document.createElement("span");
      span.className = "tok";
      span.textContent = token;
      keys.appendChild(span);
    });
    panel.appendChild(keys);
    heads.appendChild(panel);
    let vmax = 0;
    weights.forEach(function (row) { row.forEach(function (w) { vmax = Math.max(vmax, w); }); });
    panel.vmax = vmax > 0 ? vmax : 1;
    panel.weights = weights;
    panel.cell = cell;
    drawHead(panel, null);
    canvas.addEventListener("mousemove", function (event) {
      const box = canvas.getBoundingClientRect();
      const j = Math.floor((event.clientX - box.left) / cell), i = Math.floor((event.clientY - box.top) / cell);
      if (i < 0 || i >= T || j < 0 || j >= S) return;
      info.textContent = section.queries[i] + " \u2192 " + section.keys[j] + ": " + weights[i][j].toFixed(3);
      if (!state.pinned) setQuery(i);
    });
  }
  statusBox.dataset.state = "ok";
  statusBox.dataset.heads = String(section.heads);
  statusBox.textContent = "ok: " + section.title + ", layer " + state.layer + ", " + section.heads + " heads rendered";
  if (state.query !== null && state.query < T) setQuery(state.query); else state.query = null;
}
function drawHead(panel, query) {
  const canvas = panel.querySelector("canvas"), context = canvas.getContext("2d"), cell = panel.cell;
  panel.weights.forEach(function (row, i) {
    row.forEach(function (w, j) {
      context.fillStyle = colour(w / panel.vmax);
      context.fillRect(j * cell, i * cell, cell, cell);
    });
  });
  if (query !== null) {
    context.strokeStyle = "#e33"; context.lineWidth = 2;
    context.strokeRect(1, query * cell + 1, canvas.width - 2, cell - 2);
  }
}
function setQuery(i) {
  state.query = i;
  document.querySelectorAll("#queries .tok").forEach(function (span, k) {
    span.classList.toggle("sel", k === i);
  });
  document.querySelectorAll(".head").forEach(function (panel) {
    const row = panel.weights[i];
    let rowMax = 0;
    row.forEach(function (w) { rowMax = Math.max(rowMax, w); });
    panel.querySelectorAll(".keys .tok").forEach(function (span, j) {
      const strength = rowMax > 0 ? row[j] / rowMax : 0;
      span.style.backgroundColor = "rgba(44, 94, 168, " + strength.toFixed(3) + ")";
      span.style.color = strength > 0.5 ? "white" : "#222";
      span.title = row[j].toFixed(4);
    });
    drawHead(panel, i);
  });
}
function select(section, layer) {
  state.section = section; state.layer = layer;
  render();
}
function selfTest() {
  let total = 0;
  DATA.sections.forEach(function (section, s) {
    for (let l = 0; l < section.layers; l++) {
      select(s, l);
      const panels = document.querySelectorAll(".head");
      if (panels.length !== section.heads) throw new Error(section.kind + " layer " + l + ": " + panels.length + " heads drawn, expected " + section.heads);
      document.querySelector("#queries .tok").dispatchEvent(new MouseEvent("mouseover", { bubbles: true }));
      panels.forEach(function (panel) {
        const spans = panel.querySelectorAll(".keys .tok");
        if (spans.length !== section.keys.length) throw new Error("key tokens missing");
        const coloured = Array.prototype.some.call(spans, function (span) { return span.style.backgroundColor !== ""; });
        if (!coloured) throw new Error(section.kind + " layer " + l + ": hover coloured no key");
      });
      total += panels.length;
    }
  });
  select(0, 0);
  statusBox.dataset.heads = String(total);
  statusBox.textContent = "ok: self-test drew " + total + " heads, hover colours keys";
}
try {
  if (!DATA.sections.length) throw new Error("no attention in the report");
  if (location.hash === "#selftest") selfTest(); else render();
  const preset = /query=(\d+)/.exec(location.hash);  // e.g. #query=3: pin a token (screenshots)
  if (preset && Number(preset[1]) < DATA.sections[state.section].queries.length) {
    state.pinned = true;
    setQuery(Number(preset[1]));
  }
} catch (error) {
  fail(error.message);
}
</script>
</body>
</html>
"""
