"""The Kubernetes model: Services, ServicePorts, EndpointSlices and Endpoints parsed from manifests
or the API server, Service CIDRs, source ranges, the node's facts and the KubeProxyConfiguration.
Values only; imports nothing above usproxy.util."""
