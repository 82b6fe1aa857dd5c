"""Stand-in for the tqdm package (not installed here; a real tqdm earlier on sys.path wins): slime's model.py:25
@624b824 imports ``tqdm`` and wraps ``forward_only``'s and ``train``'s micro-batches in a progress bar
(model.py:465-484, 817-840: ``update(1)`` per micro-batch, ``close()``). A bar that counts and draws nothing."""


class tqdm:
    def __init__(self, iterable=None, total=None, **kwargs):
        self.iterable, self.total, self.n = iterable, total, 0

    def __iter__(self):
        return iter(self.iterable or ())

    def update(self, n=1):
        self.n += n

    def close(self):
        pass
