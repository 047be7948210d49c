"""The stand-in API server (tests/sources/fake_apiserver.py) as a process of its own, for the
control-plane bench: its CPU is not the agent's, and the agent reaches it over TCP as it would a
real one.

    python -m bench.fake_api OBJECTS.json        # prints "ready <url>", then reads commands:
    apply <resource> <json object>               # create or replace: a watch event follows
    quit

OBJECTS.json: {"services": [...], "endpointslices": [...]}.
"""

from __future__ import annotations

import asyncio
import json
import sys

from tests.sources.fake_apiserver import FakeApiServer


async def main(path: str) -> None:
    api = FakeApiServer(bookmark_interval=5.0)
    objects = json.loads(open(path).read())
    for resource, items in objects.items():
        for obj in items:
            api.apply(resource, obj)
    await api.start()
    print(f"ready {api.url}", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or line.strip() == "quit":
            break
        verb, resource, body = line.split(" ", 2)
        if verb == "apply":
            api.apply(resource, json.loads(body))
            print("applied", flush=True)
    await api.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
