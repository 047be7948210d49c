"""Kernel offload: move established ServicePorts from the relay into kernel maps.

`kernel_datapath.KernelDatapath` is what nftables and BPF implement; the offload manager decides
when a ServicePort is established (usable endpoints stable for `--offload-after`), applies it to
the kernel datapaths in one transaction each, and demotes it back to the relay on failure.
"""
