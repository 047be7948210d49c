"""The fake API server (tests/sources/fake_apiserver.py) as a Pod's in-cluster configuration
reaches it: HTTPS with a certificate for 127.0.0.1 signed by a throwaway CA, a bearer token, and
the service-account directory the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount
(token, ca.crt, namespace). The token is the DaemonSet's ServiceAccount's, and the server enforces
RBAC with the shipped examples/kubernetes/rbac.yaml as written (tests/sources/fake_rbac.py): a
request the ClusterRole does not allow gets the real server's 403 (recorded in `api.denied`).

`ApiServerThread` runs it on its own event loop in a thread, listening inside a network
namespace (the node's: the DaemonSet is on the host network), so the tests stay synchronous;
`call()` runs a FakeApiServer method on that loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

import yaml

from tests.netns import inside
from tests.sources.fake_apiserver import FakeApiServer
from tests.sources.fake_rbac import Rbac, service_account_groups, service_account_user

RBAC_FILE = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "rbac.yaml"


def shipped_rbac() -> tuple[Rbac, str, str]:
    """RBAC of the shipped manifest, and its ServiceAccount's namespace and name."""
    docs = [d for d in yaml.safe_load_all(RBAC_FILE.read_text()) if d]
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    return Rbac.from_objects(docs), sa["metadata"]["namespace"], sa["metadata"]["name"]


def service_account(directory: Path) -> tuple[Path, Path, str]:
    """Write a CA-signed certificate for 127.0.0.1 and the service-account files into `directory`
    (`directory/serviceaccount`); returns (certificate chain, key, token)."""
    sa = directory / "serviceaccount"
    sa.mkdir(parents=True)
    ca_key, ca_crt = directory / "ca.key", sa / "ca.crt"
    key, csr, crt = directory / "server.key", directory / "server.csr", directory / "server.crt"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    subprocess.run(["openssl", "req", "-x509", "-sha256", "-days", "1", *ec, "-keyout", str(ca_key),
                    "-out", str(ca_crt), "-subj", "/CN=test-ca"], check=True, capture_output=True)
    subprocess.run(["openssl", "req", "-sha256", *ec, "-keyout", str(key), "-out", str(csr),
                    "-subj", "/CN=kube-apiserver"], check=True, capture_output=True)
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    subprocess.run(["openssl", "x509", "-req", "-sha256", "-days", "1", "-in", str(csr), "-CA", str(ca_crt),
                    "-CAkey", str(ca_key), "-CAcreateserial", "-extfile", str(ext), "-out", str(crt)],
                   check=True, capture_output=True)
    token = secrets.token_hex(16)
    (sa / "token").write_text(token)
    (sa / "namespace").write_text("kube-system")
    return crt, key, token


class ApiServerThread:
    """A FakeApiServer over HTTPS listening on 127.0.0.1 in netns `ns`, served by a thread of its own."""

    def __init__(self, ns: str, directory: Path) -> None:
        crt, key, self.token = service_account(directory)
        self.service_account_dir = directory / "serviceaccount"
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(crt, key)
        rbac, namespace, name = shipped_rbac()
        self.api = FakeApiServer(ssl_context=context, bookmark_interval=0.5, rbac=rbac,
                                 users={self.token: (service_account_user(namespace, name),
                                                     service_account_groups(namespace))})
        self.ns = ns
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        with inside(self.ns):  # setns is per thread: the loop's sockets are made in the node's netns
            self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.api.start(), self.loop).result(10)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` (a FakeApiServer method) on the server's loop; its result."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args))
            except Exception as err:  # handed to the caller
                fut.set_exception(err)
        self.loop.call_soon_threadsafe(run)
        return fut.result(10)

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.api.stop(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.loop.close()
