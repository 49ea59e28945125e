// The fedgpu dashboard: polls the aggregator's JSON and redraws. Every value from the server
// goes into the page as text (textContent, SVG attributes), never as HTML.
"use strict";

(() => {
  const POLL_MS = 2000;
  const ROUND_ROWS = 20;
  const charts = window.FedgpuCharts;
  const $ = (id) => document.getElementById(id);
  const view = {offset: 0, limit: 50, search: "", state: "", jobs: true, busy: false,
    again: false, timer: 0};
  // What the tests (and a curious operator's console) read: refresh count and timings in ms.
  const dash = window.fedgpuDash = {refreshes: 0, fetchMs: null, renderMs: null,
    refreshMs: null, firstRenderAt: null, error: null};

  // ---- formatting ----------------------------------------------------------------------
  const dash0 = "-";
  function num(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return dash0;
    return Number(v).toFixed(digits === undefined ? 3 : digits);
  }
  function mib(v) { return v === null || v === undefined ? dash0 : `${Math.round(v)} MiB`; }
  function ago(s) {
    if (s === null || s === undefined) return dash0;
    if (s < 60) return `${s.toFixed(1)} s ago`;
    if (s < 3600) return `${Math.floor(s / 60)} min ago`;
    return `${(s / 3600).toFixed(1)} h ago`;
  }
  function duration(s) {
    if (s === null || s === undefined) return dash0;
    const h = Math.floor(s / 3600);
    const m = Math.floor((s % 3600) / 60);
    return h ? `${h} h ${m} min` : m ? `${m} min ${Math.floor(s % 60)} s` : `${s.toFixed(0)} s`;
  }
  function clock(epoch) {
    return epoch ? new Date(epoch * 1000).toLocaleString() : dash0;
  }

  // ---- DOM helpers -----------------------------------------------------------------------
  function h(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else node.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.appendChild(typeof c === "string" || typeof c === "number"
        ? document.createTextNode(String(c)) : c);
    }
    return node;
  }
  function text(id, value) { $(id).textContent = value; }
  function replaceRows(tbody, rows) {
    const frag = document.createDocumentFragment();
    rows.forEach((r) => frag.appendChild(r));
    tbody.replaceChildren(frag);
  }

  // ---- data ------------------------------------------------------------------------------
  async function getJson(path) {
    const r = await fetch(path, {credentials: "same-origin", cache: "no-store",
      headers: {Accept: "application/json"}});
    if (r.status === 401) {
      location.assign("/login");
      throw new Error("logged out");
    }
    if (r.status === 404 && path.startsWith("/api/jobs")) return null;
    if (!r.ok) {
      let why = `HTTP ${r.status}`;
      try { why = (await r.json()).error || why; } catch (e) { /* not JSON */ }
      throw new Error(`${path.split("?")[0]}: ${why}`);
    }
    return r.json();
  }

  function nodesPath() {
    const q = new URLSearchParams({offset: view.offset, limit: view.limit});
    if (view.search) q.set("q", view.search);
    if (view.state) q.set("state", view.state);
    return `/api/nodes?${q}`;
  }

  async function refresh() {
    if (view.busy) {
      // A click or a search while a refresh is out: run again as soon as it is back.
      view.again = true;
      return;
    }
    view.busy = true;
    view.again = false;
    clearTimeout(view.timer);
    const t0 = performance.now();
    try {
      const [status, nodes, rounds, jobs] = await Promise.all([
        getJson("/api/status"), getJson(nodesPath()), getJson("/api/rounds?summary=1&last=200"),
        view.jobs ? getJson("/api/jobs") : Promise.resolve(null)]);
      const t1 = performance.now();
      view.jobs = jobs !== null;
      render(status, nodes, rounds, jobs);
      const t2 = performance.now();
      Object.assign(dash, {fetchMs: t1 - t0, renderMs: t2 - t1, refreshMs: t2 - t0,
        maxRefreshMs: Math.max(dash.maxRefreshMs || 0, t2 - t0), error: null});
      dash.refreshes += 1;
      // From navigation start to the first complete page (scripts, data and drawing).
      if (dash.refreshes === 1) dash.firstRenderAt = performance.now();
      document.body.dataset.refreshes = dash.refreshes;
      text("timing", `${Math.round(t1 - t0)} ms fetch + ${Math.round(t2 - t1)} ms render`);
      $("error").hidden = true;
    } catch (e) {
      dash.error = e.message;
      $("error").textContent = `Cannot refresh: ${e.message}`;
      $("error").hidden = false;
    } finally {
      view.busy = false;
      view.timer = setTimeout(tick, view.again ? 0 : POLL_MS);
    }
  }

  function tick() {
    // A hidden tab asks for nothing; it refreshes as soon as it is shown again.
    if (document.hidden) view.timer = setTimeout(tick, POLL_MS);
    else refresh();
  }

  // ---- rendering -------------------------------------------------------------------------
  function render(status, nodes, rounds, jobs) {
    renderStatus(status, nodes.summary);
    renderJobs(jobs);
    renderStatistics(status.statistics);
    window.FedgpuCrossSite.render(status.cross_site);  // cross_site.js
    renderCharts(rounds);
    renderSites(nodes);
    renderRounds(rounds);
    text("updated", new Date().toLocaleTimeString());
  }

  function renderStatus(s, summary) {
    const badge = $("run-state");
    badge.textContent = s.state;
    badge.className = `badge state-${s.state}`;
    text("run-id", s.run_id);
    text("run-task", `${s.task} · ${s.mode} · ${s.strategy}`);
    text("ov-round", `${s.round} / ${s.rounds}`);
    text("ov-nodes", `${s.nodes.alive} / ${s.nodes.registered}`);
    text("ov-accuracy", num(s.accuracy, 3));
    text("ov-loss", num(s.loss, 3));
    text("ov-devices", Object.entries(summary.devices).map(([k, v]) => `${v} ${k}`)
      .join(" · ") || dash0);
    text("ov-uptime", duration(s.uptime_s));
    text("version", s.version);
    const cur = s.current_round;
    $("current-none").hidden = !!cur;
    $("current-open").hidden = !cur;
    if (cur) {
      text("current-label", `round ${cur.round} (${cur.kind}, attempt ${cur.attempt})`);
      $("current-progress").max = Math.max(1, cur.participants);
      $("current-progress").value = cur.accepted;
      text("current-counts", `${cur.accepted} of ${cur.participants} updates, ` +
        `${cur.outstanding} outstanding`);
      text("current-deadline", `deadline in ${cur.deadline_in_s} s`);
    }
    $("run-error").hidden = !s.error;
    $("run-error").textContent = s.error ? `error: ${s.error}` : "";
    const list = $("rejections");
    const entries = Object.entries(s.rejections || {}).sort((a, b) => b[1] - a[1]);
    const most = Math.max(1, ...entries.map((e) => e[1]));
    list.replaceChildren(...(entries.length ? entries.map(([reason, count]) =>
      h("li", {"data-reason": reason}, h("span", {class: "reason"}, reason),
        h("meter", {min: 0, max: most, value: count}), h("b", {}, count)))
      : [h("li", {class: "muted"}, "none")]));
  }

  function renderJobs(jobs) {
    $("jobs").hidden = jobs === null;
    if (jobs === null) return;
    const list = Array.isArray(jobs) ? jobs : jobs.jobs || [];
    replaceRows($("jobs-table").tBodies[0], list.map((j) => h("tr", {"data-job": j.job_id},
      h("td", {}, j.job_id), h("td", {}, j.name || dash0), h("td", {}, j.task),
      h("td", {}, h("span", {class: `badge state-${j.state}`}, j.state),
        j.reason ? h("div", {class: "sub"}, j.reason) : null,
        j.error ? h("div", {class: "sub error"}, j.error) : null),
      h("td", {}, h("progress", {max: Math.max(1, j.rounds || 0), value: j.rounds_done || 0}),
        ` ${j.rounds_done || 0} / ${j.rounds || 0}`),
      h("td", {}, num(j.accuracy)), h("td", {}, num(j.loss)),
      h("td", {}, clock(j.submitted_at)), h("td", {}, clock(j.started_at)),
      h("td", {}, clock(j.finished_at)))));
  }

  // mode = "statistics": the job's per-site and combined figures (status --json "statistics").
  function renderStatistics(st) {
    $("statistics").hidden = !st || !st.combined;
    if (!st || !st.combined) return;
    const rel = st.release || {};
    text("statistics-note", `${Object.keys(st.sites || {}).length} site(s), min_count ` +
      `${rel.min_count}, noise ${rel.noise}; quantiles from ${st.quantiles_from}`);
    const qs = ["p5", "p25", "p50", "p75", "p95"];
    const row = (name, site, c, held) => h("tr", {"data-column": name, "data-site": site},
      h("td", {}, name), h("td", {}, site), h("td", {}, num(c.count, 0)), h("td", {}, num(c.mean)),
      h("td", {}, num(c.std)), h("td", {}, num(c.min)),
      ...qs.map((q) => h("td", {}, num((c.quantiles || {})[q]))), h("td", {}, num(c.max)),
      h("td", {}, held));
    const rows = [];
    for (const [name, c] of Object.entries(st.combined)) {
      const cells = (c.suppressed_cells || []).reduce((a, b) => a + b, 0);
      rows.push(row(name, "combined", c, `${cells} cell(s)`));
      for (const [site, cols] of Object.entries(st.sites || {})) {
        const sc = cols[name];
        if (!sc) continue;
        rows.push(sc.suppressed ? row(name, site, {}, "whole column")
          : row(name, site, sc, `${(sc.histogram || []).filter((v) => v === null).length} cell(s)`));
      }
    }
    replaceRows($("statistics-table").tBodies[0], rows);
  }

  function renderCharts(rounds) {
    // One accuracy point per finished round with its evaluation; the starting model (round 0)
    // is a series of its own.
    const finished = rounds.rounds.filter((r) => r.status === "finished");
    const init = rounds.initial_eval || {};
    const start = init.accuracy !== null && init.accuracy !== undefined ? [[0, init.accuracy]] : [];
    const evaluated = finished.filter((r) => r.eval);
    const acc = evaluated.filter((r) => r.eval.accuracy !== null).map((r) => [r.round, r.eval.accuracy]);
    const evalLoss = evaluated.filter((r) => r.eval.loss !== null).map((r) => [r.round, r.eval.loss]);
    if (init.loss !== null && init.loss !== undefined) evalLoss.unshift([0, init.loss]);
    const train = finished.filter((r) => r.train_loss !== null).map((r) => [r.round, r.train_loss]);
    charts.lineChart($("chart-accuracy"), [
      {name: "accuracy", cls: "accuracy", points: acc},
      {name: "starting model", cls: "initial", points: start}], {yMin: 0, yMax: 1, xLabel: "round"});
    charts.lineChart($("chart-loss"), [
      {name: "train", cls: "train", points: train},
      {name: "eval", cls: "eval", points: evalLoss}], {yMin: 0, xLabel: "round"});
    const closed = rounds.rounds.filter((r) => r.duration_s !== null);
    charts.lineChart($("chart-time"), [
      {name: "round", cls: "duration", points: closed.map((r) => [r.round, r.duration_s])},
      {name: "upload max", cls: "upload", points: closed.filter((r) => r.upload_s)
        .map((r) => [r.round, r.upload_s.max])}], {yMin: 0, xLabel: "round"});
  }

  function gpuOf(n) {
    const d = n.gpu_decision || {};
    const gpus = (n.devices && n.devices.gpus) || [];
    return gpus.find((g) => g.uuid && g.uuid === d.gpu_uuid) || null;
  }

  function siteRow(n) {
    const d = n.gpu_decision || {};
    const gpus = (n.devices && n.devices.gpus) || [];
    const gpu = gpuOf(n);
    const res = n.last_resources || {};
    const gpuCell = d.gpu_name || d.gpu_uuid
      ? [h("div", {}, d.gpu_name || dash0), h("div", {class: "sub mono"}, d.gpu_uuid || ""),
        h("div", {class: "sub"}, `index ${d.gpu_index} · ${gpus.length} GPU${gpus.length === 1 ? "" : "s"} on host`)]
      : [h("div", {}, gpus.length ? `${gpus.length} GPUs, none used` : "no GPU"),
        n.devices && n.devices.nvml_reason ? h("div", {class: "sub"}, n.devices.nvml_reason) : null];
    const warnings = d.warnings && d.warnings.length
      ? h("ul", {class: "warnings"}, ...d.warnings.map((w) => h("li", {}, w))) : null;
    let memory;
    if (gpu) {
      const used = res.nvml_used_after_mib !== null && res.nvml_used_after_mib !== undefined
        ? res.nvml_used_after_mib : gpu.memory_used_mib;
      memory = [h("div", {}, `${mib(used)} / ${mib(gpu.memory_total_mib)}`),
        gpu.memory_total_mib ? h("meter", {min: 0, max: gpu.memory_total_mib, value: used || 0})
          : null];
    } else {
      memory = [h("div", {}, res.rss_peak_mib ? `RSS peak ${mib(res.rss_peak_mib)}` : dash0)];
    }
    const svg = charts.svgElement("svg", {class: "spark", viewBox: "0 0 120 34",
      "data-node": n.name});
    const hist = n.memory_history || [];
    const gpuHist = hist.filter((p) => p.peak !== null && p.peak !== undefined);
    charts.sparkline(svg, gpuHist.length
      ? ["before", "peak", "after"].map((k) => ({name: k, cls: k,
        points: gpuHist.filter((p) => p[k] !== null).map((p) => [p.round, p[k]])}))
      : [{name: "RSS peak", cls: "rss", points: hist.filter((p) => p.rss_peak !== null)
        .map((p) => [p.round, p.rss_peak])}]);
    return h("tr", {"data-node": n.name, "data-state": n.state},
      h("td", {class: "name"}, h("div", {}, n.name),
        h("div", {class: "sub"}, `${n.address} · v${n.version}`)),
      h("td", {}, h("span", {class: `badge state-${n.state}`}, n.state)),
      h("td", {}, ago(n.last_seen_s)),
      h("td", {class: "gpu"}, ...gpuCell),
      h("td", {class: "decision", "data-device": d.device || ""},
        h("span", {class: `device device-${d.device}`}, d.device || dash0), " ",
        h("span", {class: "mode"}, d.mode ? `--gpu ${d.mode}` : ""),
        h("div", {class: "reason"}, d.reason || ""), warnings),
      h("td", {class: "memory"}, ...memory),
      h("td", {}, svg),
      h("td", {}, `${n.rounds_completed}`, n.rounds_failed
        ? h("div", {class: "sub error"}, `${n.rounds_failed} failed`) : null));
  }

  function renderSites(page) {
    const s = page.summary;
    text("sites-summary", `${s.alive} alive of ${s.registered} · ${s.gpus} GPUs seen`);
    const select = $("sites-state");
    const known = new Set([...select.options].map((o) => o.value));
    for (const st of Object.keys(s.states)) {
      if (!known.has(st)) select.appendChild(h("option", {value: st}, st));
    }
    const first = page.total ? page.offset + 1 : 0;
    text("sites-range", `${first}–${page.offset + page.nodes.length} of ${page.total}`);
    $("sites-prev").disabled = page.offset === 0;
    $("sites-next").disabled = page.offset + page.limit >= page.total;
    replaceRows($("sites-table").tBodies[0], page.nodes.map(siteRow));
  }

  // A secure round: sites masked of sampled, drops by stage, masks recovered, protocol time.
  function secureCell(sa) {
    if (!sa) return [dash0];
    const drops = Object.entries(sa.dropped || {}).map(([stage, n]) => `${stage} ${n}`);
    return [
      h("div", {class: "masked"}, sa.masked === null || sa.masked === undefined
        ? `${sa.sites} sites` : `${sa.masked} / ${sa.sites} masked`),
      drops.length ? h("div", {class: "sub dropped"}, `dropped: ${drops.join(", ")}`) : null,
      sa.recovered ? h("div", {class: "sub recovered"}, `${sa.recovered} recovered`) : null,
      sa.sums ? h("div", {class: "sub sums"}, "sums: " + [
        ["examples", "examples"], ["steps", "steps"], ["examples_per_s", "examples/s"]]
        .filter(([k]) => sa.sums[k] !== undefined && sa.sums[k] !== null)
        .map(([k, label]) => `${num(sa.sums[k], 0)} ${label}`).join(" · ")) : null,
      h("div", {class: "sub protocol"}, `protocol ${num(sa.protocol_s, 2)} s` +
        (sa.unmask_s !== null && sa.unmask_s !== undefined
          ? ` (unmask ${num(sa.unmask_s, 2)} s)` : "") +
        (sa.ring_bits ? ` · Z_2^${sa.ring_bits}` : "")),
      sa.failed ? h("div", {class: "sub error"}, `failed at ${sa.failed.stage}: ${sa.failed.reason}`)
        : null];
  }

  // The latest round's evaluation: its weighted accuracy, each site's in a fold-out.
  function evalCell(ev) {
    const sites = ev.sites || [];
    if (!sites.length) return [num(ev.accuracy)];
    return [num(ev.accuracy), h("details", {class: "per-site"}, h("summary", {}, "per site"),
      h("ul", {}, ...sites.map((x) => h("li", {"data-node": x.node},
        `${x.node}: accuracy ${num(x.accuracy)}, loss ${num(x.loss)} on ` +
        `${x.num_examples} examples`)),
        ev.sites_not_listed ? h("li", {class: "muted"}, `${ev.sites_not_listed} more`) : null))];
  }

  // A time-budgeted round: the spread of steps and examples, and each site's in a fold-out.
  function workCell(w) {
    if (!w) return [dash0];
    const range = (s) => (s ? (s.min === s.max ? `${s.min}` : `${s.min}–${s.max}`) : dash0);
    const sites = w.sites || [];
    return [
      h("div", {class: "spread"}, `${range(w.steps)} steps · ${range(w.examples)} examples`),
      h("div", {class: "sub"}, `budget ${num(w.budget_s, 1)} s`),
      sites.length ? h("details", {class: "per-site"}, h("summary", {}, "per site"),
        h("ul", {}, ...sites.map((x) => h("li", {"data-node": x.node},
          `${x.node}: ${x.steps === null ? dash0 : x.steps} steps, ` +
          `${x.examples === null ? dash0 : x.examples} examples`)),
          w.sites_not_listed ? h("li", {class: "muted"}, `${w.sites_not_listed} more`) : null))
        : null];
  }

  function renderRounds(rounds) {
    text("rounds-summary", rounds.total ? `${rounds.total} closed` : "");
    // Device time of the job (every worker's device counted), per site in the tooltip.
    const dev = rounds.device_seconds;
    text("ov-gpu-hours", dev ? (dev.total / 3600).toFixed(3) : "-");
    $("ov-gpu-hours").title = dev ? Object.entries(dev.per_site)
      .map(([site, s]) => `${site}: ${(s / 3600).toFixed(3)} h`).join("\n") : "";
    const rows = rounds.rounds.slice(-ROUND_ROWS).reverse().map((r) => {
      const ev = r.eval || {};
      const rejected = Object.entries(r.rejected).map(([k, v]) => `${k}=${v}`).join(", ");
      return h("tr", {"data-round": r.round, "data-status": r.status},
        h("td", {}, r.attempt > 1 ? `${r.round} (attempt ${r.attempt})` : `${r.round}`),
        h("td", {}, h("span", {class: `badge state-${r.status}`}, r.status)),
        h("td", {}, r.participants), h("td", {}, r.nodes_reporting), h("td", {}, r.dropped),
        h("td", {}, num(r.train_loss)), h("td", {}, num(ev.loss)), h("td", {class: "accuracy"}, ...evalCell(ev)),
        h("td", {}, num(r.duration_s, 1)),
        h("td", {}, r.upload_s ? `${num(r.upload_s.max, 2)} / ${num(r.upload_s.median, 2)}`
          : dash0),
        h("td", {}, num(r.aggregation_s, 3)),
        h("td", {}, rejected || (r.failures ? `${r.failures} failed` : dash0)),
        h("td", {class: "epsilon"}, num(r.epsilon, 3)),
        h("td", {class: "secure"}, ...secureCell(r.secure_aggregation)),
        h("td", {class: "work"}, ...workCell(r.work)));
    });
    replaceRows($("rounds-table").tBodies[0], rows);
    replaceRows($("round-links"), linkLines(rounds));
  }

  // Slow links: each site's transfer in the open round, then why the last round left sites
  // out or asked them to compress (server/views/link_view.py).
  function linkLines(rounds) {
    const mbit = (b) => (b ? `${(b * 8 / 1e6).toFixed(1)} Mbit/s` : dash0);
    const items = [];
    const open = rounds.open;
    if (open) {
      items.push(h("li", {}, `round ${open.round}: deadline in ${num(open.deadline_in_s, 0)} s`));
      for (const s of open.sites) {
        const parts = [s.node, s.phase || s.state];
        if (s.direction) parts.push(s.direction);
        if (s.bytes !== undefined) parts.push(`${(s.bytes / 1e6).toFixed(1)}/${(s.size / 1e6).toFixed(1)} MB`);
        if (s.rate_bytes_per_s) parts.push(`at ${mbit(s.rate_bytes_per_s)}`);
        if (s.time_left_s !== undefined && s.time_left_s !== null) parts.push(`~${num(s.time_left_s, 0)} s left`);
        // The last transfer of this round that ended: the rate it moved at.
        if (s.last) parts.push(`(${s.last.direction} ${(s.last.bytes / 1e6).toFixed(1)} MB in ${num(s.last.seconds, 1)} s at ${mbit(s.last.rate_bytes_per_s)})`);
        items.push(h("li", {"data-transfer": s.node}, parts.join(" ")));
      }
    }
    const last = rounds.rounds.length ? rounds.rounds[rounds.rounds.length - 1].link : null;
    if (last) {
      for (const s of last.skipped) items.push(h("li", {"data-skipped": s.node}, `skipped ${s.node}: ${s.reason}`));
      for (const c of last.compressed) items.push(h("li", {"data-compressed": c.node}, `compressed ${c.node}: ${c.reason}`));
    }
    return items;
  }

  // ---- controls --------------------------------------------------------------------------
  let searchTimer = 0;
  $("sites-search").addEventListener("input", (e) => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => {
      view.search = e.target.value.trim();
      view.offset = 0;
      refresh();
    }, 250);
  });
  $("sites-state").addEventListener("change", (e) => {
    view.state = e.target.value;
    view.offset = 0;
    refresh();
  });
  $("sites-prev").addEventListener("click", () => {
    view.offset = Math.max(0, view.offset - view.limit);
    refresh();
  });
  $("sites-next").addEventListener("click", () => {
    view.offset += view.limit;
    refresh();
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
  // Who is logged in and what their role lets them do (read-only for viewers).
  getJson("/api/me").then((me) => {
    const acts = Object.keys(me.may).filter((call) => me.may[call]);
    const reads = me.role === "viewer" ? "read only" : acts.join(", ");
    text("who", `${me.name} · ${me.role}` +
      (me.studies.length ? ` (${me.studies.join(", ")})` : ""));
    $("who").title = `may: ${reads}`;
    document.body.dataset.role = me.role;
  }).catch(() => { /* an older aggregator: no /api/me */ });

  refresh();
})();
