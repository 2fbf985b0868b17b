"""Initiator side of the transfer-engine check Mooncake's CI runs (see README.md): six
unittest cases over ``mooncake.engine`` only, so they run on Mooncake's wheel and, through
``python -m ferry.alias install``, on Ferry.

Environment (as Mooncake's test): TARGET_SERVER_NAME, INITIATOR_SERVER_NAME (default
127.0.0.1:12347), MC_METADATA_SERVER, PROTOCOL, CIRCLE (round trips of the first case, default
1000).
"""

import os
import random
import string
import unittest

from mooncake.engine import TransferEngine

CAPACITY = 64 * 1024 * 1024
UNKNOWN = "unreachable_peer:9"  # published nowhere: the metadata lookup itself fails
ALPHABET = string.ascii_letters + string.digits + string.punctuation


def text(n):
    return "".join(random.choices(ALPHABET, k=n)).encode()


class TransferEngineCiCases(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.target = os.environ.get("TARGET_SERVER_NAME", "127.0.0.1:12345")
        cls.me = os.environ.get("INITIATOR_SERVER_NAME", "127.0.0.1:12347")
        cls.metadata = os.environ.get("MC_METADATA_SERVER", "127.0.0.1:2379")
        cls.rounds = int(os.environ.get("CIRCLE", "1000"))
        cls.engine = TransferEngine()
        rc = cls.engine.initialize(cls.me, cls.metadata, os.environ.get("PROTOCOL", "tcp"), "")
        if rc != 0:
            raise RuntimeError(f"initialize returned {rc}")
        if cls.metadata == "P2PHANDSHAKE":
            cls.me = f"{cls.me.rpartition(':')[0]}:{cls.engine.get_rpc_port()}"
        cls.managed = None

    @classmethod
    def tearDownClass(cls):
        if cls.managed is not None:
            cls.engine.free_managed_buffer(cls.managed, CAPACITY)

    @classmethod
    def local_buffer(cls):
        addr = cls.engine.get_first_buffer_address(cls.me)
        if addr == 0:
            if cls.managed is None:
                cls.managed = cls.engine.allocate_managed_buffer(CAPACITY)
                if cls.managed == 0:
                    raise RuntimeError("allocate_managed_buffer failed")
            addr = cls.managed
        return addr

    def remote_buffer(self):
        addr = self.engine.get_first_buffer_address(self.target)
        self.assertNotEqual(addr, 0, f"{self.target} publishes no buffer")
        return addr

    def put_local(self, addr, data):
        self.assertEqual(self.engine.write_bytes_to_buffer(addr, data, len(data)), 0)

    def test_random_write_then_read_round_trips(self):
        e, src, dst = self.engine, self.local_buffer(), self.remote_buffer()
        for i in range(self.rounds):
            data = text(random.randint(16, 256))
            self.put_local(src, data)
            self.assertEqual(e.transfer_sync_write(self.target, src, dst, len(data)), 0, f"round {i}: write")
            self.put_local(src, bytes(len(data)))
            self.assertEqual(e.transfer_sync_read(self.target, src, dst, len(data)), 0, f"round {i}: read")
            self.assertEqual(e.read_bytes_from_buffer(src, len(data)), data, f"round {i}: bytes differ")

    def batch_rounds(self, write, read):
        src, dst = self.local_buffer(), self.remote_buffer()
        slots = 100
        srcs = [src + k * 1024 for k in range(slots)]
        dsts = [dst + k * 1024 for k in range(slots)]
        for i in range(max(2, self.rounds // 100)):
            chunks = [text(random.randint(32, 128)) for _ in range(slots)]
            lens = [len(c) for c in chunks]
            for a, c in zip(srcs, chunks):
                self.put_local(a, c)
            self.assertEqual(write(srcs, dsts, lens), 0, f"round {i}: batch write")
            for a, n in zip(srcs, lens):
                self.put_local(a, bytes(n))
            self.assertEqual(read(srcs, dsts, lens), 0, f"round {i}: batch read")
            for k, (a, c) in enumerate(zip(srcs, chunks)):
                self.assertEqual(self.engine.read_bytes_from_buffer(a, len(c)), c, f"round {i} slot {k}")

    def test_batch_sync_write_then_read(self):
        e, t = self.engine, self.target
        self.batch_rounds(
            lambda s, d, n: e.batch_transfer_sync_write(t, s, d, n),
            lambda s, d, n: e.batch_transfer_sync_read(t, s, d, n),
        )

    def test_batch_async_write_then_read(self):
        e, t = self.engine, self.target

        def run(submit):
            def go(s, d, n):
                batch = submit(t, s, d, n)
                self.assertNotEqual(batch, 0, "submission failed")
                return e.get_batch_transfer_status([batch])

            return go

        self.batch_rounds(run(e.batch_transfer_async_write), run(e.batch_transfer_async_read))

    def test_async_submits_to_an_unknown_peer_return_zero(self):
        self.assertEqual(self.engine.batch_transfer_async_write(UNKNOWN, [0], [0], [16]), 0)
        self.assertEqual(self.engine.transfer_submit_write(UNKNOWN, 0, 0, 16), 0)

    def test_probe_of_the_target_succeeds(self):
        self.assertEqual(self.engine.send_probe(self.target), 0)

    def test_probe_of_an_unknown_peer_fails(self):
        self.assertNotEqual(self.engine.send_probe(UNKNOWN), 0)


if __name__ == "__main__":
    unittest.main()
