"""vitp.utils: the helpers every layer shares."""
import socket

from vitp.utils import divisors, free_port


def test_divisors_lists_every_divisor_in_order():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(7) == [1, 7]
    assert divisors(1) == [1]
    assert divisors(0) == []


def test_free_port_can_be_bound():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
