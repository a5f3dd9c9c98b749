// pdserve's dashboard: polls dashboard/data every 2 s, keeps the history here in the page (the router
// keeps only the last minute it computes the figures over, so any number of open pages cost it one
// sample a second), and draws it with uPlot. window.pdserve exposes the state (polls, charts,
// history) for tests and for a look from the browser's console.
"use strict";

(() => {
  const POLL_MS = 2000;
  const MAX_POINTS = 900; // 30 minutes at one poll every 2 s
  const DATA_URL = "dashboard/data"; // relative: the page works behind a proxy's path prefix too
  const COLORS = ["#1a73e8", "#e8710a", "#188038", "#9334e6", "#d01884", "#12b5cb", "#7cb342", "#795548"];
  const SLO_COLOR = "#c5221f";

  // times[i] is a sample's Unix time; series[key][i] its value of `key` (null: not known then, e.g. a
  // replica that was down or did not exist yet). A key shows up when first seen, backfilled with nulls.
  const history = { times: [], series: {} };
  const state = { polls: 0, errors: 0, charts: {}, history, last: null };
  window.pdserve = state;

  function record(t, values) {
    if (history.times.length && t <= history.times[history.times.length - 1]) {
      return; // the router answered the sample it had (it samples once a second at most)
    }
    history.times.push(t);
    const n = history.times.length;
    for (const key of new Set([...Object.keys(history.series), ...Object.keys(values)])) {
      const values_of_key = history.series[key] || (history.series[key] = new Array(n - 1).fill(null));
      values_of_key.push(values[key] ?? null);
    }
    if (n > MAX_POINTS) {
      history.times.shift();
      for (const [key, values_of_key] of Object.entries(history.series)) {
        values_of_key.shift();
        if (values_of_key.every((v) => v === null)) delete history.series[key]; // a replica long gone
      }
    }
  }

  // -- the charts ------------------------------------------------------------------------------

  function perReplica(what) {
    return () => Object.keys(history.series).filter((k) => k.startsWith(what + ":")).sort()
      .map((key) => ({ key, label: key.slice(what.length + 1) }));
  }

  function latencyLines(what) {
    return () => [
      { key: `${what}_p50`, label: "p50" },
      { key: `${what}_p90`, label: "p90" },
      { key: `slo_${what}`, label: "SLO", stroke: SLO_COLOR, dash: [6, 4] },
    ];
  }

  const CHARTS = {
    ttft: { el: "chart-ttft", title: "TTFT over the last minute (ms)", lines: latencyLines("ttft") },
    tpot: { el: "chart-tpot", title: "TPOT (inter-token) over the last minute (ms)", lines: latencyLines("tpot") },
    rps: { el: "chart-rps", title: "requests/s over the last minute", lines: () => [{ key: "rps", label: "requests/s" }] },
    hits: { el: "chart-hits", title: "prefix-cache hit rate over the last minute (%)",
            lines: () => [{ key: "hit_rate", label: "hit rate" }] },
    running: { el: "chart-running", title: "running requests, per replica", lines: perReplica("running") },
    waiting: { el: "chart-waiting", title: "waiting requests (queue), per replica", lines: perReplica("waiting") },
    kv: { el: "chart-kv", title: "KV blocks used (%), per replica", lines: perReplica("kv") },
  };

  function size(el) {
    return { width: Math.max(300, el.clientWidth - 8), height: 200 };
  }

  function draw() {
    for (const [name, spec] of Object.entries(CHARTS)) {
      const el = document.getElementById(spec.el);
      // A line whose key was never seen is left out (an SLO with no target, a role the cluster lacks).
      const lines = spec.lines().filter((l) => l.key in history.series);
      const signature = lines.map((l) => l.key).join("|");
      let chart = state.charts[name];
      if (!chart || chart.signature !== signature) { // the set of lines changed: uPlot's series are fixed
        if (chart) chart.destroy();
        el.textContent = "";
        chart = new uPlot({
          title: spec.title, ...size(el),
          scales: { x: { time: true } },
          series: [{}, ...lines.map((l, i) => ({
            label: l.label, stroke: l.stroke || COLORS[i % COLORS.length], width: 2, dash: l.dash, spanGaps: false,
          }))],
          axes: [{}, { size: 55 }],
        }, [history.times, ...lines.map(() => [])], el);
        chart.signature = signature;
        state.charts[name] = chart;
      }
      chart.setData([history.times, ...lines.map((l) => history.series[l.key])]);
    }
  }

  window.addEventListener("resize", () => {
    for (const [name, spec] of Object.entries(CHARTS)) {
      if (state.charts[name]) state.charts[name].setSize(size(document.getElementById(spec.el)));
    }
  });

  // -- the tables and figures ------------------------------------------------------------------

  function healthClass(health) {
    return health === "serving" ? "good" : health === "draining" ? "warn" : "bad";
  }

  function fillTable(id, rows) {
    const body = document.querySelector(`#${id} tbody`);
    body.textContent = "";
    for (const { cells, health } of rows) {
      const tr = body.insertRow();
      cells.forEach((cell, i) => {
        const td = tr.insertCell();
        td.textContent = cell ?? "-";
        if (i === health) td.className = healthClass(cell);
      });
    }
  }

  function ms(seconds) {
    return seconds == null ? null : seconds * 1000;
  }

  function showLatency(id, p90Ms, targetMs) {
    const el = document.getElementById(id);
    el.textContent = p90Ms == null ? "-" : `${p90Ms.toFixed(1)} ms`;
    el.className = "value " + (p90Ms == null || !targetMs ? "" : p90Ms > targetMs ? "bad" : "good");
    el.title = targetMs ? `SLO ${targetMs} ms` : "no SLO target";
  }

  function show(d) {
    const badge = document.getElementById("state");
    badge.textContent = d.state;
    badge.className = "badge " + (d.state === "running" ? "good" : d.state === "degraded" ? "bad" : "warn");
    const from = d.source === "controller" ? "the cluster's status" : "this router's own view (no controller)";
    document.getElementById("meta").textContent =
      `${d.router || "router"} · ${from} · ${new Date(d.time * 1000).toLocaleTimeString()}`;
    const lat = d.latency;
    document.getElementById("latency-title").textContent = lat
      ? `Service over the last ${Math.round(lat.window_s)} s` : "Service: collecting (a second sample is needed)";
    document.getElementById("rps").textContent = lat ? lat.requests_per_s.toFixed(2) : "-";
    showLatency("ttft-p90", ms(lat?.ttft_p90), d.slo.ttft_ms);
    showLatency("tpot-p90", ms(lat?.tpot_p90), d.slo.tpot_ms);
    document.getElementById("hit-rate").textContent =
      lat?.prefix_hit_rate == null ? "-" : `${(100 * lat.prefix_hit_rate).toFixed(0)} %`;

    const roles = {};
    for (const r of d.replicas) {
      const role = roles[r.role] || (roles[r.role] = { serving: 0, all: 0 });
      role.all += 1;
      role.serving += r.health === "serving" ? 1 : 0;
    }
    document.getElementById("roles").textContent = Object.entries(roles)
      .map(([role, n]) => `${role}: ${n.serving}/${n.all} serving`).join(" · ") || "no replicas known";
    fillTable("replicas", d.replicas.map((r) => ({
      health: 2,
      cells: [r.role, r.name, r.health, r.running, r.waiting,
              r.kv_total == null ? null : `${r.kv_used}/${r.kv_total}`, r.restarts],
    })));
    fillTable("routers", d.routers.map((r) => ({ health: 2, cells: [r.name, r.pid, r.health, r.streaming, r.restarts] })));
  }

  function sample(d) {
    const lat = d.latency;
    const v = {};
    if (lat) {
      Object.assign(v, { ttft_p50: ms(lat.ttft_p50), ttft_p90: ms(lat.ttft_p90), tpot_p50: ms(lat.tpot_p50),
                         tpot_p90: ms(lat.tpot_p90), rps: lat.requests_per_s,
                         hit_rate: lat.prefix_hit_rate == null ? null : 100 * lat.prefix_hit_rate });
    }
    if (d.slo.ttft_ms) v.slo_ttft = d.slo.ttft_ms;
    if (d.slo.tpot_ms) v.slo_tpot = d.slo.tpot_ms;
    for (const r of d.replicas) {
      if (r.running == null) continue; // down or draining: a gap in its lines
      v[`running:${r.name}`] = r.running;
      v[`waiting:${r.name}`] = r.waiting;
      v[`kv:${r.name}`] = r.kv_total ? (100 * r.kv_used) / r.kv_total : 0;
    }
    return v;
  }

  async function poll() {
    const error = document.getElementById("error");
    try {
      const response = await fetch(DATA_URL, { cache: "no-store" });
      if (!response.ok) throw new Error(`${DATA_URL}: HTTP ${response.status}`);
      const d = await response.json();
      state.last = d;
      record(d.time, sample(d));
      show(d);
      draw();
      state.polls += 1;
      error.hidden = true;
    } catch (e) { // the router restarting, the network: say so, and keep polling
      state.errors += 1;
      error.textContent = `no data: ${e.message}`;
      error.hidden = false;
    }
    setTimeout(poll, POLL_MS);
  }

  poll();
})();
