// usproxy's live page: reads the agent's server-sent events (/view/stream) and, per Service, its
// drawings and rules (/view/service). Nothing is polled: the agent pushes a snapshot while the page
// is open, and offload/demotion events as they happen.
"use strict";

const HIGHLIGHT_MS = 6000;  // how long an added, removed or re-readied endpoint stays highlighted
let previous = new Map();   // ServicePort name -> Map(endpoint address -> usable) in the last snapshot
const changes = new Map();  // ServicePort name -> {added: Set, removed: Set, readiness: Map(address -> usable), until: ms}
let openedOne = false;      // the first Service with a usable endpoint is opened once, then left to the reader

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c);
  return e;
}

function frontends(s) {
  const out = s.clusterIPs.map(ip => (ip.includes(":") ? `[${ip}]` : ip) + `:${s.port}/${s.protocol}`);
  if (s.nodePort) out.push(`NodePort ${s.nodePort}`);
  for (const ip of s.externalIPs) out.push(`external ${ip}:${s.port}`);
  return out.join(", ");
}

function serviceOf(spn) { return spn.split(":")[0]; }

function noteChanges(services, now) {
  const seen = new Map();
  for (const s of services) {
    const eps = new Map(s.endpoints.map(e => [e.address, e.usable]));
    seen.set(s.servicePortName, eps);
    const old = previous.get(s.servicePortName);
    if (!old) continue;
    const added = new Set([...eps.keys()].filter(a => !old.has(a)));
    const removed = new Set([...old.keys()].filter(a => !eps.has(a)));
    // the same endpoint listed before and now, turned ready or not ready: a readiness-only change
    const readiness = new Map([...eps].filter(([a, u]) => old.has(a) && old.get(a) !== u));
    if (added.size || removed.size || readiness.size) {
      changes.set(s.servicePortName, {added, removed, readiness, until: now + HIGHLIGHT_MS});
    }
  }
  previous = seen;
}

function endpointCell(s, now) {
  const td = el("td");
  const ch = changes.get(s.servicePortName);
  const live = ch && ch.until > now;
  for (const e of s.endpoints) {
    const turned = live && ch.readiness.has(e.address);
    const cls = ["ep", e.usable ? "" : "unusable", live && ch.added.has(e.address) ? "added" : "",
                 turned ? "readiness" : ""];
    const title = turned ? (e.usable ? "just became ready" : "just became not ready")
                         : (e.ready ? "ready" : "not ready");
    td.append(el("span", {class: cls.join(" ").replace(/ +/g, " ").trim(), title}, e.address));
  }
  if (live) for (const a of ch.removed) td.append(el("span", {class: "ep removed", title: "removed"}, a));
  if (!s.endpoints.length && !live) td.append("none");
  return td;
}

function relayedFlows(flows) {
  const out = new Map();  // "ns/name:port/PROTO" -> relay flows
  for (const f of flows) if (f.datapath === "userspace") out.set(f.service, (out.get(f.service) || 0) + 1);
  return out;
}

function reasonCell(s, relayed) {
  const td = el("td", {class: "reason"}, s.reason);
  const n = relayed.get(`${s.servicePortName}/${s.protocol}`) || 0;
  if (n && s.datapath.split("+").includes("bpf")) {
    td.append(el("div", {class: "why"}, `${n} relayed flow${n > 1 ? "s" : ""}: the BPF socket LB rewrites ` +
      "connect() only for processes inside its cgroup (--bpf-cgroup); clients outside it, and traffic " +
      "from other hosts that no tc program serves, still reach the relay's listener"));
  }
  return td;
}

function renderServices(services, flows) {
  const now = Date.now();
  noteChanges(services, now);
  const relayed = relayedFlows(flows);
  const body = document.querySelector("#services tbody");
  const rows = services.map(s => {
    const kernel = s.datapath !== "userspace";
    const tr = el("tr", {"data-spn": s.servicePortName},
      el("td", {}, s.servicePortName), el("td", {}, frontends(s)), endpointCell(s, now),
      el("td", {class: "datapath"}, el("span", {class: "dp " + (kernel ? "kernel" : "userspace")}, s.datapath)),
      reasonCell(s, relayed));
    const ch = changes.get(s.servicePortName);
    if (ch && ch.until > now) tr.classList.add("changed");
    return tr;
  });
  body.replaceChildren(...rows);
  document.getElementById("svc-count").textContent = `${services.length} ServicePorts`;
}

function renderFlows(flows, total) {
  const rows = flows.map(f => el("tr", {"data-flow": f.id},
    el("td", {}, f.datapath), el("td", {}, f.service), el("td", {}, f.protocol),
    el("td", {}, `${f.original.src} → ${f.original.dst}`), el("td", {}, f.endpoint || ""), el("td", {}, f.state || "")));
  document.querySelector("#flows tbody").replaceChildren(...rows);
  document.getElementById("flow-count").textContent = total > flows.length ? `${flows.length} of ${total}` : `${total}`;
}

function eventText(ev) {
  // what happened, in words: the reason of a demotion is the kernel's or the datapath's own
  const why = (ev.reason || "").replace(/^demoted: /, "");
  if (ev.kind === "offloaded") {
    return `${ev.servicePortName} offloaded to ${ev.datapath}: its endpoints held still for --offload-after, ` +
      "so the kernel serves its new connections (flows already in the relay finish there)";
  }
  if (ev.kind === "demoted") {
    return `${ev.servicePortName} demoted, back to the relay: ${why}; it is tried again once its endpoints ` +
      "have held still for another --offload-after";
  }
  return `${ev.servicePortName} back to the relay (userspace): ${why}`;
}

function addEvent(ev) {
  const when = new Date(ev.at * 1000).toLocaleTimeString();
  const li = el("li", {class: ev.kind}, el("time", {}, when), " ", eventText(ev));
  const list = document.getElementById("events");
  list.prepend(li);
  while (list.children.length > 100) list.lastChild.remove();
}

function refreshPaths(services) {
  // One <details> per Service, those a connection can reach first; a Service's drawings are fetched
  // when it is open and whenever its endpoints, their readiness or its datapath change while open.
  const byService = new Map();  // "ns/name" -> [state text, has a usable endpoint]
  for (const s of services) {
    const key = serviceOf(s.servicePortName);
    const [text, any] = byService.get(key) || ["", false];
    byService.set(key, [text + s.servicePortName + "=" + s.datapath + ":" +
                        s.endpoints.map(e => e.address + e.usable).join(",") + ";",
                        any || s.endpoints.some(e => e.usable)]);
  }
  const order = [...byService].sort((a, b) => (b[1][1] - a[1][1]) || a[0].localeCompare(b[0]));
  const root = document.getElementById("paths");
  for (const [name, [state, reachable]] of order) {
    let box = [...root.children].find(d => d.dataset.service === name);
    if (!box) {
      box = el("details", {class: "service", "data-service": name}, el("summary", {}, name));
      box.addEventListener("toggle", () => { if (box.open) fetchService(box); });
      root.append(box);
      if (reachable && !openedOne) { openedOne = true; box.open = true; }
    }
    box.dataset.state = state;
    if (box.open && box.dataset.drawn !== state) fetchService(box);
  }
  for (const d of [...root.children]) if (!byService.has(d.dataset.service)) d.remove();
}

async function fetchService(box) {
  const state = box.dataset.state;
  if (box.dataset.asked === state) return;  // already on its way
  box.dataset.asked = state;
  const r = await fetch("/view/service?name=" + encodeURIComponent(box.dataset.service));
  if (!r.ok) { box.dataset.asked = ""; return; }
  drawService(box, await r.json());
  box.dataset.drawn = state;
}

function drawMode(m) {
  const pic = el("div", {class: "drawing"});
  pic.innerHTML = m.svgs.join("\n");
  const box = el("div", {class: "mode", "data-mode": m.mode}, el("h3", {}, m.title), pic, el("pre", {class: "rules"}, m.rules));
  if (m.live) {
    const live = el("div", {class: "drawing live"});
    live.innerHTML = m.live.svgs.join("\n");
    box.append(el("h4", {class: "live"}, m.live.title), live, el("pre", {class: "rules live"}, m.live.rules));
  }
  return box;
}

function drawService(box, detail) {
  for (const m of [...box.querySelectorAll(":scope > .mode")]) m.remove();
  for (const m of detail.modes) box.append(drawMode(m));
  const now = Date.now();
  for (const [spn, ch] of changes) {
    if (serviceOf(spn) !== detail.service || ch.until <= now) continue;
    for (const g of box.querySelectorAll("g.backend")) {
      const a = g.dataset.endpoint;
      if (ch.added.has(a) || ch.readiness.get(a) === true) g.classList.add("added");
    }
  }
}

async function measure() {
  const body = document.querySelector("#numbers .body");
  body.textContent = "measuring…";
  const r = await fetch("/view/numbers");
  body.innerHTML = r.ok ? (await r.json()).html : `<p>could not measure: ${r.status}</p>`;
}

async function tour() {
  const r = await fetch("/view/tour");
  const html = r.ok ? (await r.json()).html : null;
  if (!html) return;
  const section = document.getElementById("tour");
  section.innerHTML = html;
  section.hidden = false;
}

function connect() {
  const status = document.getElementById("status");
  const src = new EventSource("/view/stream");
  src.onopen = () => { status.textContent = "live"; status.className = "status on"; };
  src.onerror = () => { status.textContent = "disconnected, retrying"; status.className = "status off"; };
  src.addEventListener("snapshot", e => {
    const snap = JSON.parse(e.data);
    renderServices(snap.services, snap.flows);
    renderFlows(snap.flows, snap.flowCount);
    refreshPaths(snap.services);
  });
  for (const kind of ["offloaded", "demoted", "userspace"]) src.addEventListener(kind, e => addEvent(JSON.parse(e.data)));
  src.addEventListener("lagged", e => {  // this page read too slowly: the agent dropped some events
    status.textContent = `live (missed ${JSON.parse(e.data).dropped} events)`;
  });
}

document.getElementById("numbers").addEventListener("toggle", e => { if (e.target.open) measure(); });
// the introduction stays as the reader left it: a returning reader sees the node first
const intro = document.getElementById("intro");
if (localStorage.getItem("usproxy.intro") === "closed") intro.open = false;
intro.addEventListener("toggle", () => localStorage.setItem("usproxy.intro", intro.open ? "open" : "closed"));
document.querySelector('#intro a[href="#numbers"]')?.addEventListener("click", () => {
  document.getElementById("numbers").open = true;
});
connect();
tour();
