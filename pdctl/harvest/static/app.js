"use strict";
// pdctl browse: hash routes #/ (overview: the grid of sites by layer x matrix, then the
// table), #/site/<site> (component table), #/c/<site>/<component> (one component),
// #/search/<q> (components firing on a token), #/clusters[/<offset>] (`pdctl cluster`'s
// clusters, a page at a time), #/cluster/<k> (one cluster).
const main = document.getElementById("main");

async function api(path) {
  const r = await fetch(path);
  if (!r.ok) throw new Error(path + ": " + r.status + " " + (await r.text()));
  return r.json();
}
// Every value from the API goes into the page through esc() (or fmt(), which escapes too),
// whatever its column's declared type: harvest.db may come from someone else.
function esc(s) {
  return String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function fmt(x, d = 3) { return x === null || x === undefined ? "" : esc(typeof x === "number" ? +x.toPrecision(d) : x); }
function list(x) { return Array.isArray(x) ? x : []; }
function bars(counts) {
  counts = list(counts).map(Number);
  const m = Math.max(1, ...counts.filter(Number.isFinite));
  return '<span class="bars">' + counts.map(n => `<span title="${esc(n)}" style="height:${Number.isFinite(n) ? Math.max(1, 24 * n / m) : 1}px"></span>`).join("") + "</span>";
}
function compLink(site, c) {
  return `<a class="component" href="#/c/${esc(encodeURIComponent(site))}/${esc(encodeURIComponent(c))}">${esc(site)} #${esc(c)}</a>`;
}
function example(e) {
  const tokens = list(e.tokens), cis = list(e.cis);
  const mid = (tokens.length - 1) / 2;
  return '<div class="ex">' + tokens.map((t, i) => {
    const a = Number.isFinite(+cis[i]) ? Math.min(1, Math.max(0, +cis[i])) : 0;
    return `<span class="${i === mid ? "here" : ""}" title="CI ${fmt(cis[i])}" style="background: rgba(220,60,40,${a})">${esc(t)}</span>`;
  }).join("") + `</div>`;
}
// A site's components by firing frequency as a small inline SVG: one bar a bin, the first
// (never fired) grey.
function histSvg(counts) {
  counts = list(counts).map(Number);
  const m = Math.max(1, ...counts.filter(Number.isFinite)), w = 7, H = 16;
  return `<svg class="hist" width="${counts.length * (w + 1)}" height="${H}" viewBox="0 0 ${counts.length * (w + 1)} ${H}" aria-hidden="true">` + counts.map((n, i) => {
    const h = Number.isFinite(n) && n > 0 ? Math.max(1, H * n / m) : 0;
    return `<rect class="${i ? "" : "dead"}" x="${i * (w + 1)}" y="${(H - h).toFixed(1)}" width="${w}" height="${h.toFixed(1)}"></rect>`;
  }).join("") + "</svg>";
}
function siteHref(site) { return `#/site/${esc(encodeURIComponent(site))}`; }

// The whole model at a glance: a row per layer, a column per matrix kind; each cell shaded
// by its L0 (against the largest), with L0, alive / C and the firing histogram.
function siteGrid(o) {
  const g = o.grid || {}, cols = list(g.columns), by = new Map(list(o.sites).map(s => [String(s.site), s]));
  const l0s = list(o.sites).map(s => +s.l0).filter(Number.isFinite);
  const top = Math.max(1e-12, ...l0s);
  const edges = esc(list(o.frequency_edges).join(" | "));
  let h = `<h2>sites by layer and matrix</h2><p class="muted">each cell: L0 (mean active components per position, shading against the largest, ${fmt(top)}), components alive / C, and its components by firing frequency (${edges}; grey: never fired). Click a cell for the site's components.</p>`;
  h += '<table id="grid"><tr><th></th>' + cols.map(c => `<th title="${esc(c.kind)}">${esc(c.label)}</th>`).join("") + "</tr>";
  for (const r of list(g.rows)) {
    h += `<tr><th>${esc(r.label)}</th>`;
    for (const name of list(r.sites)) {
      const s = name === null || name === undefined ? null : by.get(String(name));
      if (!s) { h += '<td class="empty"></td>'; continue; }
      const a = Number.isFinite(+s.l0) ? Math.min(1, Math.max(0, +s.l0 / top)) : 0;
      const tip = `${s.site}\nL0 ${s.l0}\nalive ${s.alive} of ${s.C}\nby firing frequency: ${list(s.frequency_hist).join(" | ")}`;
      h += `<td class="cell" style="background: rgba(74,123,208,${(0.06 + 0.6 * a).toFixed(3)})"><a class="cell" href="${siteHref(s.site)}" title="${esc(tip)}"><span class="l0">${fmt(s.l0, 2)}</span><span class="alive">${esc(s.alive)}/${esc(s.C)}</span>${histSvg(s.frequency_hist)}</a></td>`;
    }
    h += "</tr>";
  }
  return h + "</table>";
}

async function overview() {
  const my = navGen;
  const o = await api("/api/overview");
  const m = o.meta;
  let h = `<h1>${esc(o.run)}</h1><p>${esc(m.kind)} run, ${esc(m.stage)} checkpoint ${esc(m.step)}: ${esc(m.n_positions)} positions harvested (${esc(m.split)}${m.options && m.options.skip_first ? `; the first ${esc(m.options.skip_first)} of each sequence left out` : ""}), CI threshold ${esc(m.threshold)}; co-occurrence ${esc(m.cooc)}</p>`;
  h += siteGrid(o);
  h += `<h2>sites</h2><table id="sites"><tr><th>site</th><th>C</th><th>alive</th><th>L0</th><th>components by firing frequency (${esc(list(o.frequency_edges).join(" | "))})</th></tr>`;
  for (const s of list(o.sites)) {
    h += `<tr><td><a class="site" href="#/site/${esc(encodeURIComponent(s.site))}">${esc(s.site)}</a></td><td>${esc(s.C)}</td><td>${esc(s.alive)}</td><td>${fmt(s.l0)}</td><td>${bars(s.frequency_hist)}</td></tr>`;
  }
  if (my !== navGen) return;
  main.innerHTML = h + "</table>";
}

async function siteTable(site, sort = "frequency", desc = "1", minF = "0") {
  const my = navGen;
  const d = await api(`/api/components?site=${encodeURIComponent(site)}&sort=${encodeURIComponent(sort)}&desc=${encodeURIComponent(desc)}&min_frequency=${encodeURIComponent(minF)}&limit=5000`);
  const cols = ["component", "count", "frequency", "mean_ci", "max_ci", "v_norm", "u_norm"];
  let h = `<h1>${esc(site)}</h1><p>${esc(d.total)} components; minimum frequency <input id="minf" value="${esc(minF)}" size="6"></p><table><tr>`;
  h += cols.map(c => `<th class="sortable" data-sort="${c}">${c}${c === sort ? (desc === "1" ? " ▼" : " ▲") : ""}</th>`).join("") + "</tr>";
  for (const r of list(d.rows)) {
    h += `<tr><td>${compLink(r.site, r.component)}</td>` + cols.slice(1).map(c => `<td>${fmt(r[c])}</td>`).join("") + "</tr>";
  }
  if (my !== navGen) return;
  main.innerHTML = h + "</table>";
  for (const th of main.querySelectorAll("th.sortable")) {
    th.onclick = () => siteTable(site, th.dataset.sort, th.dataset.sort === sort && desc === "1" ? "0" : "1", minF);
  }
  document.getElementById("minf").onchange = e => siteTable(site, sort, desc, e.target.value);
  await labelColumn(site);
}

// Labels from `pdctl interp import` (and their scores from `pdctl interp score`), if any.
async function labelColumn(site) {
  const my = navGen;
  const d = await api(`/api/labels?site=${encodeURIComponent(site)}`);
  const by = new Map(list(d.rows).map(r => [String(r.component), r]));
  if (!by.size || my !== navGen) return;
  const rows = main.querySelectorAll("table tr");
  rows.forEach((tr, i) => {
    const cell = document.createElement(i ? "td" : "th");
    const a = tr.querySelector("a.component");
    const c = a ? decodeURIComponent(a.getAttribute("href").split("/").pop()) : null;
    const r = c === null ? null : by.get(c);
    if (!i) cell.textContent = "label";
    else if (r) { cell.className = "label"; cell.textContent = String(r.label); }
    tr.appendChild(cell);
  });
}
async function labelSection(site, c) {
  const my = navGen;
  const d = await api(`/api/labels?site=${encodeURIComponent(site)}&component=${encodeURIComponent(c)}`);
  const r = list(d.rows)[0];
  if (!r || my !== navGen) return;
  let h = `<p id="label"><b>label</b>: <span class="label">${esc(r.label)}</span>`;
  for (const k of ["detection", "fuzzing", "confidence"]) {
    if (r[k] !== null && r[k] !== undefined) h += `; ${k} ${fmt(r[k])}`;
  }
  if (r.source !== null && r.source !== undefined) h += ` (${esc(r.source)})`;
  h += "</p>";
  if (r.reasoning) h += `<p class="muted">${esc(r.reasoning)}</p>`;
  document.getElementById("component-title").insertAdjacentHTML("afterend", h);
}

async function component(site, c) {
  const my = navGen;
  const d = await api(`/api/component/${encodeURIComponent(site)}/${c}`);
  let h = `<h1 id="component-title">${esc(site)} #${esc(c)}</h1>`;
  h += `<p>fires on ${esc(d.count)} positions (frequency ${fmt(d.frequency)}), mean CI ${fmt(d.mean_ci)}, max CI ${fmt(d.max_ci)}; |V[:, c]| ${fmt(d.v_norm)}, |U[c, :]| ${fmt(d.u_norm)}</p>`;
  h += `<p>CI histogram (0 → 1) ${bars(d.hist)}</p>`;
  h += siblings(site, c, d.siblings || {});
  h += await clusterSection(site, c);
  if (list(d.features).length) {
    h += "<h2>one-hot features</h2><p>" + list(d.features).map(f => `feature ${esc(f.feature)}: ${fmt(f.ci)}`).join(", ") + "</p>";
  }
  h += "<h2>top examples</h2>" + (list(d.top).map(example).join("") || '<p class="muted">none</p>');
  h += "<h2>sampled firing examples</h2>" + (list(d.sample).map(example).join("") || '<p class="muted">none</p>');
  for (const k of ["count", "pmi"]) {
    const t = list(d["tokens_" + k]);
    if (t.length) h += `<h2>input tokens by ${k}</h2><p>` + t.map(x => `<code>${esc(vis(x.token))}</code> ${esc(x.count)} (PMI ${fmt(x.pmi)})`).join(", ") + "</p>";
  }
  for (const k of ["raised", "lowered"]) {
    const t = list((d.effects || {})[k]);
    if (t.length) h += `<h2>next tokens it ${k} (ablated where it fires, nats)</h2><p>` + t.map(x => `<code>${esc(vis(x.token))}</code> ${fmt(x.nats)}`).join(", ") + "</p>";
  }
  h += "<h2>fires together with</h2><table><tr><th>component</th><th>count</th><th>precision</th><th>recall</th><th>Jaccard</th><th>PMI</th></tr>";
  h += list(d.cooc).map(r => `<tr><td>${compLink(r.other_site, r.other_component)}</td><td>${esc(r.count)}</td><td>${fmt(r.precision)}</td><td>${fmt(r.recall)}</td><td>${fmt(r.jaccard)}</td><td>${fmt(r.pmi)}</td></tr>`).join("") + "</table>";
  const like = await api(`/api/like/${encodeURIComponent(site)}/${c}`);
  h += "<h2>components like this one (shared top tokens)</h2><p>" + (list(like.rows).map(r => compLink(r.site, r.component) + ` (${esc(r.shared)})`).join(", ") || '<span class="muted">none</span>') + "</p>";
  h += await attributionsSection(site, c);
  if (my !== navGen) return;
  main.innerHTML = h;
  await labelSection(site, c);
}

// Component c at the other sites of its layer: under nonlinearity_aligned init (C = the MLP's
// neurons) component c of gate / up / down started as MLP neuron c.
function siblings(site, c, s) {
  const rows = list(s.rows);
  if (s.layer === null || s.layer === undefined || rows.length < 2) return "";
  const same = rows.some(r => r.same_neuron);
  let h = `<h2 id="siblings">#${esc(c)} at the other sites of layer ${esc(s.layer)}</h2>`;
  h += `<p class="muted">${same ? "decomp.init = nonlinearity_aligned: the rows marked <b>same neuron</b> started as the same MLP neuron as this one" : `decomp.init = ${esc(s.init)}: the same index at another site is another component, not the same neuron (only nonlinearity_aligned with C = the MLP's neurons starts component c of gate / up / down as neuron c)`}</p>`;
  h += '<table id="siblings-table"><tr><th>site</th><th></th><th>count</th><th>frequency</th><th>mean CI</th><th>max CI</th><th>cluster</th><th>label</th></tr>';
  for (const r of rows) {
    const k = r.cluster === null || r.cluster === undefined ? "" : `<a href="#/cluster/${esc(encodeURIComponent(r.cluster))}">${esc(r.cluster)}</a>`;
    h += `<tr class="${r.this ? "this" : ""}"><td>${r.this ? `<b>${esc(r.site)} #${esc(r.component)}</b>` : compLink(r.site, r.component)}</td><td>${r.same_neuron ? '<span class="badge">same neuron</span>' : ""}</td><td>${esc(r.count)}</td><td>${fmt(r.frequency)}</td><td>${fmt(r.mean_ci)}</td><td>${fmt(r.max_ci)}</td><td>${k}</td><td class="label">${r.label === null || r.label === undefined ? "" : esc(r.label)}</td></tr>`;
  }
  return h + "</table>";
}

// `pdctl cluster` and `pdctl attributions`: their sections of a component's page, and the
// cluster list. Attributions colour a token by its gradient x input: red raises the CI, blue
// lowers it (scaled by the example's largest magnitude).
function attrExample(e) {
  const tokens = list(e.tokens), attrs = list(e.attrs).map(Number);
  const m = Math.max(1e-30, ...attrs.filter(Number.isFinite).map(Math.abs));
  const mid = (attrs.length - 1) / 2;
  return '<div class="ex attr">' + attrs.map((v, i) => {
    const a = Number.isFinite(v) ? Math.min(1, Math.abs(v) / m) : 0;
    const rgb = v >= 0 ? "220,60,40" : "40,90,220";
    return `<span class="${i === mid ? "here" : ""}" title="attribution ${fmt(v)}" style="background: rgba(${rgb},${a})">${esc(i < tokens.length ? tokens[i] : "")}</span>`;
  }).join("") + "</div>";
}

// The component's cluster: the other members (short names for a layer's sites), where they
// sit and the cluster's top input tokens.
async function clusterSection(site, c) {
  const k = await api(`/api/cluster_of/${encodeURIComponent(site)}/${c}`);
  let h = '<h2 id="cluster">cluster</h2>';
  if (!k.available) return h + '<p class="muted">no clusters yet (`pdctl cluster`)</p>';
  if (k.cluster === null) return h + '<p class="muted">not clustered (it fired too rarely)</p>';
  const members = list(k.members), others = members.filter(m => !(m.site === site && +m.component === +c));
  h += `<p><a href="#/cluster/${esc(encodeURIComponent(k.cluster))}">cluster ${esc(k.cluster)}</a>: ` + (others.map(memberLink).join(" ") || '<span class="muted">alone</span>') + "</p>";
  if (others.length) h += `<p class="muted">${esc(members.length)} members, ${esc(where(members))}</p>`;
  if (list(k.tokens).length) h += `<p>the cluster's top input tokens: ${tokenList(k.tokens)}</p>`;
  return h;
}

async function attributionsSection(site, c) {
  const a = await api(`/api/attributions/${encodeURIComponent(site)}/${c}`);
  let h = '<h2 id="attributions">what raises its CI (gradient × input over its top examples)</h2>';
  if (!a.available) return h + '<p class="muted">no attributions yet (`pdctl attributions`, LMs)</p>';
  if (!list(a.inputs).length) return h + '<p class="muted">not attributed (`pdctl attributions --components N`)</p>';
  h += "<p>input positions (offset from the firing token): " + list(a.inputs).map(r => `${esc(r.offset)}: ${fmt(r.attr)}`).join(", ") + "</p>";
  for (const kind of ["raises", "lowers"]) {
    const rows = list(a[kind]);
    if (rows.length) h += `<p>upstream components that ${kind === "raises" ? "raise" : "lower"} it: ` + rows.map(r => compLink(r.source_site, r.source_component) + ` ${fmt(r.attr)}`).join(", ") + "</p>";
  }
  return h + list(a.examples).map(attrExample).join("");
}

// A cluster as a row: where its members sit, its top input tokens (the members' counts
// summed) and their labels, one representative example, and the members themselves (a
// member of a layer named short: "L7 gate #11", its whole site in the link's title).
// A token on its own, its white space made visible (␣ space, ↵ new line, ⇥ tab).
function vis(t) { return String(t).replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥"); }
function tokenList(tokens) {
  return list(tokens).map(t => `<code title="#${esc(t.id)}: ${esc(t.count)} firings, in ${esc(t.members)} member(s)' top tokens">${esc(vis(t.token))}</code> ${esc(t.count)}`).join(", ");
}
function short(kind) { return String(kind).split(".").pop(); }
function ranges(ns) {
  const out = [];
  for (const n of ns) {
    const last = out[out.length - 1];
    if (last && n === last[1] + 1) last[1] = n; else out.push([n, n]);
  }
  return out.map(([a, b]) => a === b ? `${a}` : `${a}-${b}`).join(", ");
}
function where(members) {
  const layers = [...new Set(members.map(m => m.layer).filter(l => Number.isInteger(l)))].sort((a, b) => a - b);
  const kinds = [...new Set(members.map(m => layers.length ? short(m.kind) : m.kind))];
  return (layers.length ? `layer${layers.length > 1 ? "s" : ""} ${ranges(layers)}: ` : "") + kinds.join(", ");
}
function memberLink(m) {
  const name = Number.isInteger(m.layer) ? `L${m.layer} ${short(m.kind)}` : String(m.site);
  return `<a class="component" title="${esc(m.site)} #${esc(m.component)}${m.label === null || m.label === undefined ? "" : ": " + esc(m.label)}" href="#/c/${esc(encodeURIComponent(m.site))}/${esc(encodeURIComponent(m.component))}">${esc(name)} #${esc(m.component)}</a>`;
}
function labelList(members) {
  const n = new Map();
  for (const m of members) if (m.label !== null && m.label !== undefined) n.set(String(m.label), (n.get(String(m.label)) || 0) + 1);
  return [...n].sort((a, b) => b[1] - a[1]).map(([l, k]) => `<span class="label">${esc(l)}</span>${k > 1 ? ` (${k})` : ""}`).join("; ");
}
const SHOWN = 12;  // members listed in a cluster's row (the cluster's page lists them all)
function clusterRow(k, all = false) {
  const members = list(k.members), shown = all ? members : members.slice(0, SHOWN);
  const href = `#/cluster/${esc(encodeURIComponent(k.cluster))}`;
  const more = members.length > shown.length ? ` <a href="${href}">+${esc(members.length - shown.length)} more</a>` : "";
  const e = k.example;
  const ex = e ? example(e) + `<div class="muted small">${esc(e.members_firing)} of ${esc(members.length)} members fire here (CI of ${esc(e.site)} #${esc(e.component)})</div>` : '<span class="muted">none</span>';
  const labels = labelList(members);
  return `<tr class="cluster"><td><a href="${href}">${esc(k.cluster)}</a></td><td>${esc(k.size)}</td><td class="where">${esc(where(members))}</td><td class="tokens">${tokenList(k.tokens) || '<span class="muted">none</span>'}${labels ? `<div class="small">labels: ${labels}</div>` : ""}</td><td class="example">${ex}</td><td class="members">${shown.map(memberLink).join(" ")}${more}</td></tr>`;
}
const CLUSTER_HEAD = '<table id="clusters"><tr><th>cluster</th><th>size</th><th>where</th><th>top input tokens; labels</th><th>representative example</th><th>members</th></tr>';
const PAGE = 50;

async function clusters(offset = 0) {
  const my = navGen;
  offset = Math.max(0, Math.floor(+offset) || 0);
  const d = await api(`/api/clusters?offset=${offset}&limit=${PAGE}`);
  let h = "<h1>clusters</h1>";
  if (!d.available) { if (my === navGen) main.innerHTML = h + '<p class="muted">none yet: run `pdctl cluster`</p>'; return; }
  const m = d.meta || {}, rows = list(d.clusters), total = +d.total || 0;
  h += `<p>${esc(m.method)}, Jaccard ≥ ${esc(m.min_jaccard)}: ${esc(d.total)} clusters of two or more, ${esc(d.singletons)} components alone</p>`;
  const nav = [];
  if (offset > 0) nav.push(`<a href="#/clusters/${Math.max(0, offset - PAGE)}">← previous ${PAGE}</a>`);
  if (rows.length) nav.push(`clusters ${offset + 1}-${offset + rows.length} of ${esc(total)}`);
  if (offset + rows.length < total) nav.push(`<a href="#/clusters/${offset + PAGE}">next ${PAGE} →</a>`);
  const pager = `<p class="pager">${nav.join(" · ")}</p>`;
  h += pager + CLUSTER_HEAD + rows.map(k => clusterRow(k)).join("") + "</table>" + (rows.length > 10 ? pager : "");
  if (my !== navGen) return;
  main.innerHTML = h;
}

async function oneCluster(k) {
  const my = navGen;
  const d = await api(`/api/cluster/${encodeURIComponent(k)}`);
  let h = `<h1>cluster ${esc(d.cluster)}</h1><p><a href="#/clusters">all clusters</a></p>`;
  h += CLUSTER_HEAD + clusterRow(d, true) + "</table>";
  h += '<h2>members</h2><table id="members"><tr><th>component</th><th>count</th><th>frequency</th><th>label</th></tr>';
  h += list(d.members).map(r => `<tr><td>${compLink(r.site, r.component)}</td><td>${esc(r.count)}</td><td>${fmt(r.frequency)}</td><td class="label">${r.label === null || r.label === undefined ? "" : esc(r.label)}</td></tr>`).join("");
  if (my !== navGen) return;
  main.innerHTML = h + "</table>";
}

async function search(q) {
  const my = navGen;
  const d = await api(`/api/search?q=${encodeURIComponent(q)}`);
  let h = `<h1>components firing on <code>${esc(q)}</code></h1><p>token ids: ${esc(list(d.ids).join(", ")) || "none"}</p><table id="results"><tr><th>component</th><th>token</th><th>count</th><th>PMI</th></tr>`;
  h += list(d.rows).map(r => `<tr><td>${compLink(r.site, r.component)}</td><td><code>${esc(vis(r.token))}</code></td><td>${esc(r.count)}</td><td>${fmt(r.pmi)}</td></tr>`).join("");
  if (my !== navGen) return;
  main.innerHTML = h + "</table>";
}

// Each navigation is a generation: a page still loading when the next navigation starts is
// dropped, not drawn over the newer one (a slow overview finishing after a fast clusters page
// would otherwise replace it), and `ready` names the route that was drawn.
let navGen = 0;
async function route() {
  const gen = ++navGen, hash = location.hash || "#/";
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  try {
    if (parts[0] === "site") await siteTable(parts[1]);
    else if (parts[0] === "c") await component(parts[1], +parts[2]);
    else if (parts[0] === "search") await search(parts.slice(1).join("/"));
    else if (parts[0] === "clusters") await clusters(parts[1] || 0);
    else if (parts[0] === "cluster") await oneCluster(parts[1]);
    else await overview();
  } catch (e) {
    if (gen === navGen) main.innerHTML = `<p class="muted">${esc(e.message)}</p>`;
  }
  if (gen === navGen) document.body.dataset.ready = hash;
}
document.getElementById("search").onsubmit = e => {
  e.preventDefault();
  location.hash = "#/search/" + encodeURIComponent(document.getElementById("q").value);
};
window.addEventListener("hashchange", route);
route();
