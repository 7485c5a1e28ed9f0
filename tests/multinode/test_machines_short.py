"""The short run of the machine scenarios, in ``make test`` (``make chaos`` adds two server machines and three
copies of every stream, ``test_machines.py``, and machine loss and partition, ``test_machine_loss.py``): the
first server machine (``--secure --tls``) in a namespace of its own, every bad join refused in one line with
nothing left behind, a worker joined with one command, app traffic between them inside WireGuard, and the
removed worker's credential dead on every server. Skipped with the reason where the machine has no root or
``ip netns``; a failure in CI."""

from __future__ import annotations

import pytest

from tests.multinode.harness import Network
from tests.multinode.worker import first_server_and_worker, removed_worker_is_dead


@pytest.mark.timeout(600)
def test_a_worker_joins_over_an_encrypted_mesh_and_its_removal_leaves_no_credential(network: Network) -> None:
    m1, w1, _ = first_server_and_worker(network)
    removed_worker_is_dead(m1, w1, [f"tls://{m1.address}:{port}" for port in (4222, 4223, 4224)])
