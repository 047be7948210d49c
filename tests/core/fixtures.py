"""Realistic `kubectl get svc,endpointslices -A -o yaml` output, written for these tests."""

KUBECTL_OUTPUT = """\
apiVersion: v1
items:
- apiVersion: v1
  kind: Service
  metadata:
    creationTimestamp: "2026-11-01T10:00:00Z"
    labels: {app: web}
    name: web
    namespace: default
    resourceVersion: "1234"
    uid: 4b1c7a0e-0000-4000-8000-000000000001
  spec:
    clusterIP: 10.96.10.10
    clusterIPs: [10.96.10.10]
    externalTrafficPolicy: Cluster
    internalTrafficPolicy: Cluster
    ipFamilies: [IPv4]
    ipFamilyPolicy: SingleStack
    ports:
    - {name: http, nodePort: 30080, port: 80, protocol: TCP, targetPort: http}
    - {name: https, nodePort: 30443, port: 443, protocol: TCP, targetPort: 8443}
    selector: {app: web}
    sessionAffinity: None
    type: NodePort
  status:
    loadBalancer: {}
- apiVersion: v1
  kind: Service
  metadata: {name: lb, namespace: shop}
  spec:
    allocateLoadBalancerNodePorts: true
    clusterIP: 10.96.20.1
    clusterIPs: [10.96.20.1, "fd00:96::14"]
    externalIPs: [203.0.113.7]
    externalTrafficPolicy: Local
    healthCheckNodePort: 31999
    ipFamilies: [IPv4, IPv6]
    ipFamilyPolicy: PreferDualStack
    ports:
    - {nodePort: 31080, port: 80, protocol: TCP, targetPort: 8080}
    sessionAffinity: ClientIP
    sessionAffinityConfig:
      clientIP: {timeoutSeconds: 600}
    type: LoadBalancer
  status:
    loadBalancer:
      ingress:
      - {ip: 198.51.100.20, ipMode: VIP}
- apiVersion: v1
  kind: Service
  metadata: {name: kube-dns, namespace: kube-system}
  spec:
    clusterIP: 10.96.0.10
    ports:
    - {name: dns, port: 53, protocol: UDP, targetPort: 53}
    - {name: dns-tcp, port: 53, protocol: TCP, targetPort: 53}
    internalTrafficPolicy: Local
    trafficDistribution: PreferClose
    type: ClusterIP
- apiVersion: v1
  kind: Service
  metadata: {name: headless, namespace: default}
  spec: {clusterIP: None, ports: [{port: 80}]}
- apiVersion: v1
  kind: Service
  metadata: {name: ext, namespace: default}
  spec: {type: ExternalName, externalName: example.org}
- apiVersion: v1
  kind: Service
  metadata:
    name: other-proxy
    namespace: default
    labels: {service.kubernetes.io/service-proxy-name: somebody-else}
  spec: {clusterIP: 10.96.30.1, ports: [{port: 80}]}
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses: [10.244.1.10]
    conditions: {ready: true, serving: true, terminating: false}
    nodeName: node-a
    targetRef: {kind: Pod, name: web-1, namespace: default}
    zone: zone-a
  - addresses: [10.244.2.10]
    conditions: {ready: false, serving: true, terminating: true}
    nodeName: node-b
  kind: EndpointSlice
  metadata:
    generateName: web-
    labels: {endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io,
             kubernetes.io/service-name: web}
    name: web-abcde
    namespace: default
  ports:
  - {name: http, port: 8080, protocol: TCP}
  - {name: https, port: 8443, protocol: TCP}
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses: [10.244.3.10]
    conditions: {}
    nodeName: node-a
  kind: EndpointSlice
  metadata:
    labels: {kubernetes.io/service-name: web}
    name: web-fghij
    namespace: default
  ports:
  - {name: http, port: 8080, protocol: TCP}
  - {name: https, port: 8443, protocol: TCP}
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses: [10.244.5.5]
    conditions: {ready: true}
    nodeName: node-a
  kind: EndpointSlice
  metadata:
    labels: {kubernetes.io/service-name: lb}
    name: lb-v4
    namespace: shop
  ports: [{name: "", port: 8080, protocol: TCP}]
- addressType: IPv6
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses: ["fd00:244::5"]
    conditions: {ready: true}
    nodeName: node-b
  kind: EndpointSlice
  metadata:
    labels: {kubernetes.io/service-name: lb}
    name: lb-v6
    namespace: shop
  ports: [{name: "", port: 8080, protocol: TCP}]
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses: [10.244.7.53]
    conditions: {ready: true}
    nodeName: node-a
    hints:
      forZones: [{name: zone-a}]
  kind: EndpointSlice
  metadata:
    labels: {kubernetes.io/service-name: kube-dns}
    name: kube-dns-1
    namespace: kube-system
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
kind: List
metadata:
  resourceVersion: ""
"""
