"""Mode: everything `usproxy explain` knows about one proxy mode, as one record.

A mode (userspace, iptables, ipvs, nftables, bpf) is a set of functions kept by the modules that
own them (the renderers, trace.py, cost.py, diff.py, reply.py, path_drawing.py); a `Mode` names
them together, and usproxy/explain/registry.py lists the records in the order every view shows
them. Callers iterate over the records and call their fields, so adding a mode means one new
record (and its functions), never a new branch in a caller. This module holds only the record
type: it imports no renderer, so every module a record points into may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from usproxy.explain.packet import Packet, Path
from usproxy.explain.path_drawing import Drawer
from usproxy.model.service_set import FamilyPort, ServiceSet
from usproxy.model.config import BpfLbMode
from usproxy.model.endpoint import Endpoint


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """The flags of `explain trace` that change a tracer's walk: `bpf_lb_mode` (as `usproxy run
    --bpf-lb-mode`, read by the bpf mode's tc program)."""

    bpf_lb_mode: BpfLbMode = "snat"


NO_OPTIONS = TraceOptions()


class Tracer(Protocol):
    """A mode's tracer: every path `pkt` may take through the rules that mode renders for `ss`."""

    def __call__(self, ss: ServiceSet, pkt: Packet, opts: TraceOptions = NO_OPTIONS) -> list[Path]: ...


Render = Callable[[ServiceSet], str]
CostRows = Callable[[ServiceSet, "Mode"], list[list[str]]]  # the mode's own record: its tracer
Sends = Callable[[ServiceSet, ServiceSet], str]  # (OLD, NEW) -> what the proxier writes, as text
Reply = Callable[[ServiceSet, Packet, Path], list[str]]
Refusal = Callable[[Packet, Path], str]
# (ServicePorts, usproxy's own table per IP family as the kernel lists it, endpoints by "ip:port")
# -> (the ServicePorts' part of it, in its own words; SVG drawings of the path through it)
LivePart = Callable[[list[FamilyPort], dict[int, str], dict[str, Endpoint]], tuple[str, list[str]]]


@dataclass(frozen=True, slots=True)
class Mode:
    """One proxy mode as explain shows it.

    - `name`: what `--mode` takes and every heading starts with; `title`: the section heading.
    - `render`: the mode's rules as it holds them; `render_dump`: the same as the transaction its
      proxier sends, where that differs (`--nft-format dump`; None: `render` serves both).
    - `trace`: the paths of one packet through the rendered rules (explain trace, cost, scale);
      `traces_pod_at_connect`: a pod's new connection is traced as a process of this node,
      served at connect() before any packet (the socket LB), not as a packet arriving.
    - `reply`: what follows the first packet of a path that reached a backend (conntrack, the
      source the backend sees, the reply); `refusal`: the one line a refused client meets.
    - `cost_rows`: the mode's rows of the "why, in numbers" table; `cost_detail`: lines under
      that table (iptables: its probability ladders), or None.
    - `sends`: what the proxier writes for one endpoint added, in its own unit (--scale);
      `diff_sends`: what kube-proxy sends for any change, for the modes whose sync kube-proxy's
      own tests size (`explain diff` prints it), or None; `scale_note`: a line under --scale's
      table, or "".
    - `drawing`: the SVG path drawing of a new connection (the web view, --html).
    - `rules_walked`: what a trace's rule count counts, after the number ("rules walked").
    - `gist`: how this mode turns a connection to a Service into one to an endpoint, in a
      sentence for someone new to it (the pages' introduction).
    - `live_part`: for a mode usproxy itself runs in a table the kernel lists (nftables), the
      Services' part of usproxy's table as read from the kernel, and its drawing (the web view
      shows it next to kube-proxy's); None for the others.
    """

    name: str
    title: str
    render: Render
    trace: Tracer
    reply: Reply
    refusal: Refusal
    cost_rows: CostRows
    sends: Sends
    drawing: Drawer
    render_dump: Render | None = None
    traces_pod_at_connect: bool = False
    cost_detail: Callable[[ServiceSet], list[str]] | None = None
    diff_sends: Sends | None = None
    scale_note: str = ""
    rules_walked: str = "rules walked"
    gist: str = ""
    live_part: LivePart | None = None

    def view(self, ss: ServiceSet, nft_format: str = "list") -> str:
        """The rules as `--nft-format` asks: the transaction dump where the mode has one."""
        if nft_format == "dump" and self.render_dump is not None:
            return self.render_dump(ss)
        return self.render(ss)
