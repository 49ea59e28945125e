// mode = "cross-site": the site x model matrix of the job in view (status --json "cross_site",
// server/views/cross_site.py). Rows are models (the global one, then each site's local model),
// columns the sites whose held-out data scored them; a model or a cell missing shows why.
"use strict";

(() => {
  function cell(tag, attrs, content) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    node.textContent = content;
    return node;
  }

  function acc(v) {
    return typeof v === "number" ? v.toFixed(4) : "–";
  }

  function render(m) {
    const panel = document.getElementById("cross-site");
    const rows = (m && m.rows) || [];
    panel.hidden = rows.length === 0;
    if (!rows.length) return;
    const sites = m.sites || [];
    document.getElementById("cross-site-note").textContent =
      `job ${m.of_job}: accuracy of each model (rows) on each site's held-out data (columns)`;
    const table = document.getElementById("cross-site-table");
    const head = document.createElement("tr");
    head.append(cell("th", {}, "model \\ data"), ...sites.map((s) => cell("th", {}, s)),
      cell("th", {}, "weighted"));
    table.tHead.replaceChildren(head);
    const body = document.createDocumentFragment();
    for (const r of rows) {
      const tr = cell("tr", {"data-model": r.model}, "");
      tr.append(cell("th", {}, r.model === "global" ? "global" : `${r.model} (local)`));
      if (r.why_not) {
        // The site's model did not come: one cell across the row says why.
        tr.append(cell("td", {"class": "why-not", "colspan": sites.length + 1}, r.why_not));
      } else {
        for (const s of sites) {
          const c = (r.cells || {})[s] || {why_not: "not scored"};
          tr.append(c.why_not ? cell("td", {"class": "why-not", "title": c.why_not}, "–")
            : cell("td", {"data-site": s, "title": `${c.num_examples} examples, loss ` +
              `${acc(c.loss)}`}, acc(c.accuracy)));
        }
        tr.append(cell("td", {}, acc((r.weighted || {}).accuracy)));
      }
      body.appendChild(tr);
    }
    table.tBodies[0].replaceChildren(body);
  }

  window.FedgpuCrossSite = {render};
})();
