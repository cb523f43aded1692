"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const VIRIDIS = ["#440154","#472d7b","#3b528b","#2c728e","#21918c","#28ae80","#5ec962","#addc30","#fde725"];
const state = { layer: (D.start || [0, 0])[0], head: (D.start || [0, 0])[1], focus: null, pinned: false, view: "both" };

function hex(c) { return [1,3,5].map(i => parseInt(c.slice(i, i+2), 16)); }
const STOPS = VIRIDIS.map(hex);
function color(t) {
  t = Math.max(0, Math.min(1, t)) * (STOPS.length - 1);
  const i = Math.min(Math.floor(t), STOPS.length - 2), f = t - i;
  const c = STOPS[i].map((a, j) => Math.round(a + (STOPS[i+1][j] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}
function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
function cur() { const L = D.layers[state.layer]; return { L, H: L.heads[state.head] }; }
function qtok(L, r) { const p = L.rows[r]; return D.tokens[p] !== undefined ? D.tokens[p] : String(p); }
function ktok(k) { return D.keyTokens[k] !== undefined ? D.keyTokens[k] : String(k); }
function measure(texts) {
  const svg = document.getElementById("lines");
  const t = el("text", { x: -1000, y: -1000 }, svg);
  let w = 0;
  for (const s of texts) { t.textContent = s; w = Math.max(w, t.getComputedTextLength()); }
  svg.removeChild(t);
  return Math.ceil(w);
}

function fillSelects() {
  const ls = document.getElementById("layer"), hs = document.getElementById("head");
  clear(ls);
  D.layers.forEach((L, i) => { const o = document.createElement("option"); o.value = i;
    o.textContent = `${L.index}` + (L.name.startsWith("attention.") ? "" : ` · ${L.name}`); ls.appendChild(o); });
  ls.value = state.layer;
  clear(hs);
  D.layers[state.layer].heads.forEach((H, i) => { const o = document.createElement("option"); o.value = i;
    o.textContent = H.head; hs.appendChild(o); });
  hs.value = state.head;
}

function drawShapes() {
  const { L, H } = cur(), box = document.getElementById("shapes");
  clear(box);
  for (const [name, shape] of L.shapes) {
    const s = document.createElement("span"); const b = document.createElement("b");
    b.textContent = name + " "; s.appendChild(b); s.appendChild(document.createTextNode(shape)); box.appendChild(s);
  }
  const extra = document.createElement("span");
  extra.textContent = `backend ${L.backend} · mask ${L.mask} · showing b=${D.b}, h=${H.head}: P[b, h] is [Q=${L.rows.length}, K=${L.K}]`;
  box.appendChild(extra);
  document.body.dataset.layer = L.index; document.body.dataset.head = H.head;
}

let LINES = null, CELLS = null, ROWBOX = null;

function drawLines() {
  const { L, H } = cur(), svg = document.getElementById("lines");
  clear(svg);
  const R = L.rows.length, K = L.K, rowH = 22, pad = 14;
  const qs = L.rows.map((_, r) => qtok(L, r)), ks = [...Array(K).keys()].map(ktok);
  const wq = measure(qs), wk = measure(ks), gap = 170;
  const xq = pad + wq, xk = xq + gap, width = xk + wk + pad + 6, height = Math.max(R, K) * rowH + 26;
  svg.setAttribute("width", width); svg.setAttribute("height", height);
  el("text", { x: xq, y: 12, "text-anchor": "end", class: "dim", style: "font-size:11px;fill:#6b7280" }, svg, "query");
  el("text", { x: xk, y: 12, style: "font-size:11px;fill:#6b7280" }, svg, "key");
  const y = i => 30 + i * rowH;
  const gl = el("g", {}, svg), gk = el("g", {}, svg), gq = el("g", {}, svg);
  LINES = [];
  for (let r = 0; r < R; r++) {
    const row = [];
    for (let k = 0; k < K; k++) {
      const w = H.w[r][k];
      row.push(el("line", { class: "w", x1: xq + 6, y1: y(r) - 4, x2: xk - 6, y2: y(k) - 4, "data-w": w }, gl));
    }
    LINES.push(row);
  }
  L._keybg = ks.map((s, k) => el("rect", { class: "keybg", x: xk - 3, y: y(k) - 15, width: measure([s]) + 6, height: 19, rx: 3, opacity: 0 }, gk));
  L._ktext = ks.map((s, k) => el("text", { x: xk, y: y(k), "data-k": k }, gk, s));
  L._qtext = qs.map((s, r) => {
    const t = el("text", { class: "tok", x: xq, y: y(r), "text-anchor": "end", "data-q": r, "data-testid": `q-${r}` }, gq, s);
    t.addEventListener("mouseenter", () => hover(r));
    t.addEventListener("mouseleave", () => hover(null));
    t.addEventListener("click", () => pin(r));
    return t;
  });
}

function drawHeatmap() {
  const { L, H } = cur(), svg = document.getElementById("heatmap");
  clear(svg);
  const R = L.rows.length, K = L.K;
  const qs = L.rows.map((_, r) => qtok(L, r)), ks = [...Array(K).keys()].map(ktok);
  const c = Math.max(8, Math.min(36, Math.floor(420 / Math.max(R, K))));
  const left = measure(qs) + 12, top = Math.ceil(measure(ks) * 0.82) + 16;
  let vmax = 1e-6; for (const row of H.w) for (const w of row) vmax = Math.max(vmax, w);
  const legendW = 56;
  svg.setAttribute("width", left + K * c + legendW + 8); svg.setAttribute("height", top + R * c + 10);
  document.getElementById("heatmap-title").textContent =
    `P[b=${D.b}, h=${H.head}]: [Q=${R}, K=${K}], layer ${L.index}`;
  const g = el("g", { transform: `translate(${left},${top})` }, svg);
  CELLS = [];
  for (let r = 0; r < R; r++) {
    const row = [];
    const sum = H.w[r].reduce((a, b) => a + b, 0);
    for (let k = 0; k < K; k++) {
      const w = H.w[r][k];
      const rect = el("rect", { class: "cell", x: k * c, y: r * c, width: c - 1, height: c - 1, fill: color(w / vmax),
        "data-q": r, "data-k": k, "data-w": w }, g);
      if (sum === 0) rect.classList.add("masked");
      el("title", {}, rect, `query ${qs[r]} → key ${ks[k]}: ${w.toFixed(4)}`);
      rect.addEventListener("mouseenter", () => hover(r, k));
      rect.addEventListener("mouseleave", () => hover(null));
      rect.addEventListener("click", () => pin(r));
      row.push(rect);
    }
    CELLS.push(row);
    const t = el("text", { class: "tok", x: -6, y: r * c + c / 2 + 4, "text-anchor": "end", "data-q": r, "data-testid": `row-${r}` }, g, qs[r]);
    t.addEventListener("mouseenter", () => hover(r));
    t.addEventListener("mouseleave", () => hover(null));
    t.addEventListener("click", () => pin(r));
    L["_hq" + r] = t;
  }
  ks.forEach((s, k) => el("text", { x: k * c + c / 2, y: -6, transform: `rotate(-55 ${k * c + c / 2} -6)`, "data-k": k }, g, s));
  ROWBOX = el("rect", { class: "rowbox", x: -1, y: 0, width: K * c + 1, height: c + 1, visibility: "hidden", "data-testid": "rowbox" }, g);
  // colour bar
  const lg = el("g", { transform: `translate(${K * c + 14},0)` }, g), n = 40, hgt = Math.min(R * c, 240);
  for (let i = 0; i < n; i++) el("rect", { x: 0, y: hgt - (i + 1) * hgt / n, width: 12, height: hgt / n + 0.5, fill: color(i / (n - 1)) }, lg);
  el("text", { x: 16, y: 10, style: "font-size:11px" }, lg, vmax.toFixed(2));
  el("text", { x: 16, y: hgt, style: "font-size:11px" }, lg, "0");
}

function drawOverview() {
  const cv = document.getElementById("overview"), ctx = cv.getContext("2d");
  const nL = D.layers.length, nH = Math.max(...D.layers.map(L => L.heads.length));
  const t = Math.max(18, Math.min(46, Math.floor(400 / nH))), gap = 4, lab = 26, top = 16;
  const dpr = window.devicePixelRatio || 1;
  const W = lab + nH * (t + gap), Hh = top + nL * (t + gap);
  cv.width = W * dpr; cv.height = Hh * dpr; cv.style.width = W + "px"; cv.style.height = Hh + "px";
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, W, Hh);
  ctx.font = "10px system-ui, sans-serif"; ctx.fillStyle = "#6b7280";
  for (let h = 0; h < nH; h++) ctx.fillText("h" + h, lab + h * (t + gap) + 2, 11);
  D.layers.forEach((L, li) => {
    ctx.fillStyle = "#6b7280"; ctx.fillText("L" + L.index, 2, top + li * (t + gap) + t / 2 + 3);
    L.heads.forEach((H, hi) => {
      const x0 = lab + hi * (t + gap), y0 = top + li * (t + gap), R = H.w.length, K = L.K;
      for (let r = 0; r < R; r++) for (let k = 0; k < K; k++) {
        ctx.fillStyle = color(H.w[r][k]);
        ctx.fillRect(x0 + k * t / K, y0 + r * t / R, t / K + 0.3, t / R + 0.3);
      }
      if (li === state.layer && hi === state.head) {
        ctx.strokeStyle = "#e4572e"; ctx.lineWidth = 2.5; ctx.strokeRect(x0 - 1.5, y0 - 1.5, t + 3, t + 3);
      }
    });
  });
  document.getElementById("stats").style.maxWidth = Math.max(W, 260) + "px";
  cv.onclick = ev => {
    const r = cv.getBoundingClientRect(), x = ev.clientX - r.left - lab, y = ev.clientY - r.top - top;
    const hi = Math.floor(x / (t + gap)), li = Math.floor(y / (t + gap));
    if (li >= 0 && li < nL && hi >= 0 && hi < D.layers[li].heads.length) select(li, hi);
  };
}

function drawStats() {
  const { L, H } = cur(), box = document.getElementById("stats");
  clear(box);
  const line = document.createElement("div");
  line.textContent = `layer ${L.index}, head ${H.head}: `;
  Object.entries(H.stats).forEach(([k, v], i) => {
    if (i) line.appendChild(document.createTextNode(" · "));
    line.appendChild(document.createTextNode(k + " "));
    const b = document.createElement("b"); b.textContent = v; line.appendChild(b);
  });
  box.appendChild(line);
}

function paint() {
  const { L, H } = cur(), f = state.focus;
  const R = L.rows.length, K = L.K;
  for (let r = 0; r < R; r++) for (let k = 0; k < K; k++) {
    const w = H.w[r][k], line = LINES[r][k];
    const on = f === null ? true : f.q === r;
    line.setAttribute("stroke-width", on ? (1 + 5 * w).toFixed(2) : 1);
    line.setAttribute("stroke-opacity", on ? (f === null ? 0.85 * w : Math.max(0.06, w)).toFixed(3) : 0.0);
    CELLS[r][k].classList.toggle("hl", f !== null && f.q === r);
  }
  L._qtext.forEach((t, r) => { t.classList.toggle("focus", f !== null && f.q === r); t.classList.toggle("dimmed", f !== null && f.q !== r); });
  for (let r = 0; r < R; r++) L["_hq" + r].classList.toggle("focus", f !== null && f.q === r);
  L._keybg.forEach((bg, k) => bg.setAttribute("opacity", f === null ? 0 : (0.75 * H.w[f.q][k]).toFixed(3)));
  const info = document.getElementById("info");
  if (f === null) {
    ROWBOX.setAttribute("visibility", "hidden");
    info.textContent = "Hover a query token (left column or heatmap row) to see where it attends; click to pin.";
    return;
  }
  ROWBOX.setAttribute("visibility", "visible");
  ROWBOX.setAttribute("y", CELLS[f.q][0].getAttribute("y") - 1);
  ROWBOX.dataset.q = f.q;
  const order = [...Array(K).keys()].sort((a, b) => H.w[f.q][b] - H.w[f.q][a]).slice(0, 4)
    .filter((k, i) => i === 0 || H.w[f.q][k] >= 0.01);
  clear(info);
  info.appendChild(document.createTextNode(`${state.pinned ? "pinned" : "query"} `));
  const b = document.createElement("b"); b.textContent = `${qtok(L, f.q)} (#${L.rows[f.q]})`; info.appendChild(b);
  let text = ` attends to: ` + order.map(k => `${ktok(k)} ${H.w[f.q][k].toFixed(2)}`).join(", ");
  if (f.k !== undefined && f.k !== null) text += ` · this cell (key ${ktok(f.k)}): ${H.w[f.q][f.k].toFixed(4)}`;
  info.appendChild(document.createTextNode(text));
}

function hover(q, k) {
  if (state.pinned) return;
  state.focus = q === null ? null : { q, k };
  paint();
}
function pin(q) {
  if (state.pinned && state.focus && state.focus.q === q) { state.pinned = false; state.focus = null; }
  else { state.pinned = true; state.focus = { q }; }
  paint();
}
function select(li, hi) {
  const keep = state.pinned ? state.focus : null;
  state.layer = li; state.head = Math.min(hi, D.layers[li].heads.length - 1);
  state.focus = keep && keep.q < D.layers[li].rows.length ? keep : null;
  state.pinned = state.focus !== null;
  render();
}
function render() {
  fillSelects(); drawShapes(); drawLines(); drawHeatmap(); drawOverview(); drawStats(); paint(); setView(state.view);
}
function setView(v) {
  state.view = v;
  document.querySelectorAll("#views button").forEach(b => b.classList.toggle("on", b.dataset.view === v));
  document.getElementById("lines-view").classList.toggle("hidden", v === "heatmap");
  document.getElementById("heatmap-view").classList.toggle("hidden", v === "lines");
}

document.getElementById("layer").addEventListener("change", e => select(+e.target.value, state.head));
document.getElementById("head").addEventListener("change", e => select(state.layer, +e.target.value));
document.querySelectorAll("#views button").forEach(b => b.addEventListener("click", () => setView(b.dataset.view)));
document.addEventListener("keydown", e => {
  if (e.target.tagName === "SELECT") return;
  const nH = D.layers[state.layer].heads.length, nL = D.layers.length;
  if (e.key === "ArrowRight") select(state.layer, (state.head + 1) % nH);
  else if (e.key === "ArrowLeft") select(state.layer, (state.head + nH - 1) % nH);
  else if (e.key === "ArrowDown") select((state.layer + 1) % nL, state.head);
  else if (e.key === "ArrowUp") select((state.layer + nL - 1) % nL, state.head);
  else if (e.key === "Escape") { state.pinned = false; state.focus = null; paint(); }
  else return;
  e.preventDefault();
});
render();
