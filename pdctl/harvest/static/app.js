"use strict";
// pdctl browse: hash routes #/ (overview), #/site/<site> (component table),
// #/c/<site>/<component> (one component), #/search/<q> (components firing on a token),
// #/clusters (`pdctl cluster`'s clusters).
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

async function overview() {
  const o = await api("/api/overview");
  const m = o.meta;
  let h = `<h1>${esc(o.run)}</h1><p>${esc(m.kind)} run, ${esc(m.stage)} checkpoint ${esc(m.step)}: ${esc(m.n_positions)} positions harvested (${esc(m.split)}), CI threshold ${esc(m.threshold)}; co-occurrence ${esc(m.cooc)}</p>`;
  h += `<table><tr><th>site</th><th>C</th><th>alive</th><th>L0</th><th>components by firing frequency (${esc(list(o.frequency_edges).join(" | "))})</th></tr>`;
  for (const s of list(o.sites)) {
    h += `<tr><td><a class="site" href="#/site/${esc(encodeURIComponent(s.site))}">${esc(s.site)}</a></td><td>${esc(s.C)}</td><td>${esc(s.alive)}</td><td>${fmt(s.l0)}</td><td>${bars(s.frequency_hist)}</td></tr>`;
  }
  main.innerHTML = h + "</table>";
}

async function siteTable(site, sort = "frequency", desc = "1", minF = "0") {
  const d = await api(`/api/components?site=${encodeURIComponent(site)}&sort=${encodeURIComponent(sort)}&desc=${encodeURIComponent(desc)}&min_frequency=${encodeURIComponent(minF)}&limit=5000`);
  const cols = ["component", "count", "frequency", "mean_ci", "max_ci", "v_norm", "u_norm"];
  let h = `<h1>${esc(site)}</h1><p>${esc(d.total)} components; minimum frequency <input id="minf" value="${esc(minF)}" size="6"></p><table><tr>`;
  h += cols.map(c => `<th class="sortable" data-sort="${c}">${c}${c === sort ? (desc === "1" ? " ▼" : " ▲") : ""}</th>`).join("") + "</tr>";
  for (const r of list(d.rows)) {
    h += `<tr><td>${compLink(r.site, r.component)}</td>` + cols.slice(1).map(c => `<td>${fmt(r[c])}</td>`).join("") + "</tr>";
  }
  main.innerHTML = h + "</table>";
  for (const th of main.querySelectorAll("th.sortable")) {
    th.onclick = () => siteTable(site, th.dataset.sort, th.dataset.sort === sort && desc === "1" ? "0" : "1", minF);
  }
  document.getElementById("minf").onchange = e => siteTable(site, sort, desc, e.target.value);
  await labelColumn(site);
}

// Labels from `pdctl interp import` (and their scores from `pdctl interp score`), if any.
async function labelColumn(site) {
  const d = await api(`/api/labels?site=${encodeURIComponent(site)}`);
  const by = new Map(list(d.rows).map(r => [String(r.component), r]));
  if (!by.size) return;
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
  const d = await api(`/api/labels?site=${encodeURIComponent(site)}&component=${encodeURIComponent(c)}`);
  const r = list(d.rows)[0];
  if (!r) return;
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
  const d = await api(`/api/component/${encodeURIComponent(site)}/${c}`);
  let h = `<h1 id="component-title">${esc(site)} #${esc(c)}</h1>`;
  h += `<p>fires on ${esc(d.count)} positions (frequency ${fmt(d.frequency)}), mean CI ${fmt(d.mean_ci)}, max CI ${fmt(d.max_ci)}; |V[:, c]| ${fmt(d.v_norm)}, |U[c, :]| ${fmt(d.u_norm)}</p>`;
  h += `<p>CI histogram (0 → 1) ${bars(d.hist)}</p>`;
  if (list(d.features).length) {
    h += "<h2>one-hot features</h2><p>" + list(d.features).map(f => `feature ${esc(f.feature)}: ${fmt(f.ci)}`).join(", ") + "</p>";
  }
  h += "<h2>top examples</h2>" + (list(d.top).map(example).join("") || '<p class="muted">none</p>');
  h += "<h2>sampled firing examples</h2>" + (list(d.sample).map(example).join("") || '<p class="muted">none</p>');
  for (const k of ["count", "pmi"]) {
    const t = list(d["tokens_" + k]);
    if (t.length) h += `<h2>input tokens by ${k}</h2><p>` + t.map(x => `<code>${esc(x.token)}</code> ${esc(x.count)} (PMI ${fmt(x.pmi)})`).join(", ") + "</p>";
  }
  for (const k of ["raised", "lowered"]) {
    const t = list((d.effects || {})[k]);
    if (t.length) h += `<h2>next tokens it ${k} (ablated where it fires, nats)</h2><p>` + t.map(x => `<code>${esc(x.token)}</code> ${fmt(x.nats)}`).join(", ") + "</p>";
  }
  h += "<h2>fires together with</h2><table><tr><th>component</th><th>count</th><th>precision</th><th>recall</th><th>Jaccard</th><th>PMI</th></tr>";
  h += list(d.cooc).map(r => `<tr><td>${compLink(r.other_site, r.other_component)}</td><td>${esc(r.count)}</td><td>${fmt(r.precision)}</td><td>${fmt(r.recall)}</td><td>${fmt(r.jaccard)}</td><td>${fmt(r.pmi)}</td></tr>`).join("") + "</table>";
  const like = await api(`/api/like/${encodeURIComponent(site)}/${c}`);
  h += "<h2>components like this one (shared top tokens)</h2><p>" + (list(like.rows).map(r => compLink(r.site, r.component) + ` (${esc(r.shared)})`).join(", ") || '<span class="muted">none</span>') + "</p>";
  h += await clusterAndAttributions(site, c);
  main.innerHTML = h;
  await labelSection(site, c);
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

async function clusterAndAttributions(site, c) {
  const k = await api(`/api/cluster_of/${encodeURIComponent(site)}/${c}`);
  let h = '<h2 id="cluster">cluster</h2>';
  if (!k.available) h += '<p class="muted">no clusters yet (`pdctl cluster`)</p>';
  else if (k.cluster === null) h += '<p class="muted">not clustered (it fired too rarely)</p>';
  else {
    const others = list(k.members).filter(m => !(m.site === site && +m.component === +c));
    h += `<p><a href="#/clusters">cluster ${esc(k.cluster)}</a>: ` + (others.map(m => compLink(m.site, m.component)).join(", ") || '<span class="muted">alone</span>') + "</p>";
  }
  const a = await api(`/api/attributions/${encodeURIComponent(site)}/${c}`);
  h += '<h2 id="attributions">what raises its CI (gradient × input over its top examples)</h2>';
  if (!a.available) return h + '<p class="muted">no attributions yet (`pdctl attributions`, LMs)</p>';
  if (!list(a.inputs).length) return h + '<p class="muted">not attributed (`pdctl attributions --components N`)</p>';
  h += "<p>input positions (offset from the firing token): " + list(a.inputs).map(r => `${esc(r.offset)}: ${fmt(r.attr)}`).join(", ") + "</p>";
  for (const kind of ["raises", "lowers"]) {
    const rows = list(a[kind]);
    if (rows.length) h += `<p>upstream components that ${kind === "raises" ? "raise" : "lower"} it: ` + rows.map(r => compLink(r.source_site, r.source_component) + ` ${fmt(r.attr)}`).join(", ") + "</p>";
  }
  return h + list(a.examples).map(attrExample).join("");
}

async function clusters() {
  const d = await api("/api/clusters");
  let h = "<h1>clusters</h1>";
  if (!d.available) { main.innerHTML = h + '<p class="muted">none yet: run `pdctl cluster`</p>'; return; }
  const m = d.meta || {};
  h += `<p>${esc(m.method)}, Jaccard ≥ ${esc(m.min_jaccard)}: ${esc(list(d.clusters).length)} clusters of two or more, ${esc(d.singletons)} components alone</p>`;
  h += '<table id="clusters"><tr><th>cluster</th><th>size</th><th>sites</th><th>members</th></tr>';
  h += list(d.clusters).map(k => `<tr><td>${esc(k.cluster)}</td><td>${esc(k.size)}</td><td>${esc(list(k.sites).join(", "))}</td><td>${list(k.members).map(r => compLink(r.site, r.component)).join(", ")}</td></tr>`).join("");
  main.innerHTML = h + "</table>";
}

async function search(q) {
  const d = await api(`/api/search?q=${encodeURIComponent(q)}`);
  let h = `<h1>components firing on <code>${esc(q)}</code></h1><p>token ids: ${esc(list(d.ids).join(", ")) || "none"}</p><table id="results"><tr><th>component</th><th>token</th><th>count</th><th>PMI</th></tr>`;
  h += list(d.rows).map(r => `<tr><td>${compLink(r.site, r.component)}</td><td><code>${esc(r.token)}</code></td><td>${esc(r.count)}</td><td>${fmt(r.pmi)}</td></tr>`).join("");
  main.innerHTML = h + "</table>";
}

async function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  try {
    if (parts[0] === "site") await siteTable(parts[1]);
    else if (parts[0] === "c") await component(parts[1], +parts[2]);
    else if (parts[0] === "search") await search(parts.slice(1).join("/"));
    else if (parts[0] === "clusters") await clusters();
    else await overview();
  } catch (e) {
    main.innerHTML = `<p class="muted">${esc(e.message)}</p>`;
  }
  document.body.dataset.ready = location.hash || "#/";
}
document.getElementById("search").onsubmit = e => {
  e.preventDefault();
  location.hash = "#/search/" + encodeURIComponent(document.getElementById("q").value);
};
window.addEventListener("hashchange", route);
route();
