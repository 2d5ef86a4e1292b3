"""The nodes' KV events into the proxy's prefix index.

Nodes with prefix caching publish, with each heartbeat, the block hashes their replicas' caches
stored and evicted (``cluster.nodes.KVEvents`` on the registry's pub/sub). ``follow_kv_events``
reads them in the background for as long as the proxy runs and applies them to the prefix index
(``proxy.routing.prefix_index``), so every proxy and every worker of one sees what the nodes hold, whoever
sent the prompts, and forgets what they evicted. Redis away: it retries with backoff; events missed
meanwhile only make the index a worse guess.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cluster.nodes import KVEvents
from proxy.routing.discovery import KVEventFeed
from proxy.routing.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

POLL_S = 0.5  # the longest one read waits (in a thread) before the loop looks again
RETRY_MAX_S = 4.0


async def follow_kv_events(open_stream: Callable[[], KVEventFeed | None], index: PrefixIndex,
                           capacity: Callable[[str], int | None],
                           on_events: Callable[[int], None] | None = None) -> None:
    """Apply KV events to ``index`` until cancelled. ``open_stream()``: a fresh subscription (None:
    the source has no events);
    ``capacity(node_id)``: the node's KV blocks per replica (None: an unknown node, skipped)."""
    failures = 0
    while True:
        stream = None
        try:
            stream = await asyncio.to_thread(open_stream)
            if stream is None:
                return
            if failures:
                log.info("following KV events again")
            failures = 0
            while True:
                batch: list[KVEvents] = await asyncio.to_thread(stream.poll, POLL_S)
                for events in batch:
                    blocks = capacity(events.node_id)
                    if blocks is not None:
                        index.apply(events, blocks)
                if batch and on_events is not None:
                    on_events(len(batch))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # Redis away, or anything else: this loop must outlive it
            if failures == 0:
                log.warning("KV events: %s; retrying", e)
            failures += 1
            await asyncio.sleep(min(0.5 * 2 ** (failures - 1), RETRY_MAX_S))
        finally:
            if stream is not None:
                stream.close()
