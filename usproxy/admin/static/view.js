// usproxy's live page: reads the agent's server-sent events (/view/stream) and, per Service, its
// drawings and rules (/view/service). Nothing is polled: the agent pushes a snapshot while the page
// is open, and offload/demotion events as they happen.
"use strict";

const HIGHLIGHT_MS = 6000;  // how long an added or removed endpoint stays highlighted
let previous = new Map();   // ServicePort name -> its endpoint addresses in the last snapshot
const changes = new Map();  // ServicePort name -> {added: Set, removed: Set, until: ms}
const serviceKeys = new Map();  // Service "ns/name" -> endpoints text when its drawings were fetched

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
    const eps = new Set(s.endpoints.map(e => e.address));
    seen.set(s.servicePortName, eps);
    const old = previous.get(s.servicePortName);
    if (!old) continue;
    const added = new Set([...eps].filter(a => !old.has(a)));
    const removed = new Set([...old].filter(a => !eps.has(a)));
    if (added.size || removed.size) changes.set(s.servicePortName, {added, removed, until: now + HIGHLIGHT_MS});
  }
  previous = seen;
}

function endpointCell(s, now) {
  const td = el("td");
  const ch = changes.get(s.servicePortName);
  const live = ch && ch.until > now;
  for (const e of s.endpoints) {
    const cls = ["ep", e.usable ? "" : "unusable", live && ch.added.has(e.address) ? "added" : ""];
    td.append(el("span", {class: cls.join(" ").trim(), title: e.ready ? "ready" : "not ready"}, e.address));
  }
  if (live) for (const a of ch.removed) td.append(el("span", {class: "ep removed", title: "removed"}, a));
  if (!s.endpoints.length && !live) td.append("none");
  return td;
}

function renderServices(services) {
  const now = Date.now();
  noteChanges(services, now);
  const body = document.querySelector("#services tbody");
  const rows = services.map(s => {
    const kernel = s.datapath !== "userspace";
    const tr = el("tr", {"data-spn": s.servicePortName},
      el("td", {}, s.servicePortName), el("td", {}, frontends(s)), endpointCell(s, now),
      el("td", {class: "datapath"}, el("span", {class: "dp " + (kernel ? "kernel" : "userspace")}, s.datapath)),
      el("td", {class: "reason"}, s.reason));
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

function addEvent(ev) {
  const when = new Date(ev.at * 1000).toLocaleTimeString();
  const li = el("li", {class: ev.kind}, `${when} ${ev.servicePortName}: ${ev.kind} → ${ev.datapath} (${ev.reason})`);
  const list = document.getElementById("events");
  list.prepend(li);
  while (list.children.length > 100) list.lastChild.remove();
}

async function refreshPaths(services) {
  const byService = new Map();
  for (const s of services) {
    const key = serviceOf(s.servicePortName);
    byService.set(key, (byService.get(key) || "") + s.servicePortName + "=" + s.endpoints.map(e => e.address + e.usable).join(",") + ";");
  }
  const root = document.getElementById("paths");
  for (const [name, eps] of byService) {
    if (serviceKeys.get(name) === eps) continue;
    serviceKeys.set(name, eps);
    const r = await fetch("/view/service?name=" + encodeURIComponent(name));
    if (!r.ok) continue;
    drawService(root, await r.json());
  }
  for (const d of [...root.children]) if (!byService.has(d.dataset.service)) { d.remove(); serviceKeys.delete(d.dataset.service); }
}

function drawService(root, detail) {
  let box = [...root.children].find(d => d.dataset.service === detail.service);
  const open = box ? box.open : root.children.length === 0;
  const fresh = el("details", {class: "service", "data-service": detail.service}, el("summary", {}, detail.service));
  fresh.open = open;
  for (const m of detail.modes) {
    const pic = el("div", {class: "drawing"});
    pic.innerHTML = m.svgs.join("\n");
    fresh.append(el("div", {class: "mode", "data-mode": m.mode}, el("h3", {}, m.title), pic, el("pre", {class: "rules"}, m.rules)));
  }
  const now = Date.now();
  for (const [spn, ch] of changes) {
    if (serviceOf(spn) !== detail.service || ch.until <= now) continue;
    for (const g of fresh.querySelectorAll("g.backend")) if (ch.added.has(g.dataset.endpoint)) g.classList.add("added");
  }
  if (box) box.replaceWith(fresh); else root.append(fresh);
}

function connect() {
  const status = document.getElementById("status");
  const src = new EventSource("/view/stream");
  src.onopen = () => { status.textContent = "live"; status.className = "status on"; };
  src.onerror = () => { status.textContent = "disconnected, retrying"; status.className = "status off"; };
  src.addEventListener("snapshot", e => {
    const snap = JSON.parse(e.data);
    renderServices(snap.services);
    renderFlows(snap.flows, snap.flowCount);
    refreshPaths(snap.services);
  });
  for (const kind of ["offloaded", "demoted", "userspace"]) src.addEventListener(kind, e => addEvent(JSON.parse(e.data)));
  src.addEventListener("lagged", e => {  // this page read too slowly: the agent dropped some events
    status.textContent = `live (missed ${JSON.parse(e.data).dropped} events)`;
  });
}

connect();
