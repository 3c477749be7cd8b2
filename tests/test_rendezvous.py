"""The rendezvous' answers, in one process: the whole start-up is tests/e2e/test_serve.py."""

from __future__ import annotations

import threading

import pytest
import zmq

from launch.procs import find_free_base_port
from launch.rendezvous import RendezvousError, register, serve_rendezvous
from protocol.messages import NodeHello


def hello(rank: int, config_hash: str = "h") -> NodeHello:
    return NodeHello(
        rank=rank,
        host=f"10.0.0.{rank + 1}",
        config_hash=config_hash,
        partition=[15, 15],
        nnodes=2,
        port=30000,
        ring_flags={"--dtype": "auto", "--pp-max-micro-batch-size": None},
    )


@pytest.fixture
def rendezvous():
    addr = f"tcp://127.0.0.1:{find_free_base_port(1)}"
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["hosts"] = serve_rendezvous(addr, 2, deadline_s=20, own=hello(0))
        except RendezvousError as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield addr, result
    thread.join(25)
    assert "error" not in result


def test_every_node_gets_the_hosts_once_all_ranks_registered(rendezvous):
    addr, _ = rendezvous
    answers: dict[int, list[str]] = {}
    node1 = threading.Thread(target=lambda: answers.update({1: register(addr, hello(1), 20)}))
    node1.start()
    answers[0] = register(addr, hello(0), 20)
    node1.join(20)
    assert answers == {0: ["10.0.0.1", "10.0.0.2"], 1: ["10.0.0.1", "10.0.0.2"]}


def test_a_different_model_and_an_unreadable_hello_get_one_sentence_each(rendezvous):
    addr, _ = rendezvous
    with pytest.raises(RendezvousError, match="node 1 loaded a different model"):
        register(addr, hello(1, config_hash="other"), 20)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(addr)
    try:
        dealer.send_multipart([b"\x81\xa1v\x09"])  # msgpack {"v": 9}: not this protocol
        assert dealer.poll(20_000), "the rendezvous did not answer"
        answer = dealer.recv_multipart()
    finally:
        dealer.close(0)
    assert b"could not read this node's hello" in answer[0]
    assert b"protocol version 9" in answer[0]
    # Neither refusal disturbed the rendezvous: the right nodes still complete it.
    threading.Thread(target=register, args=(addr, hello(1), 20), daemon=True).start()
    assert register(addr, hello(0), 20) == ["10.0.0.1", "10.0.0.2"]
