"""Where one batch entry's query rows and keys live, for the three layouts a spec may name.

* dense: (batch, heads, seq, head_dim) tensors; every sequence has the tensor's length.
* ``varlen``: a packed batch viewed as (1, heads, total rows, head_dim); sequence ``b`` holds rows
  ``cu_seqlens[b] .. cu_seqlens[b + 1]`` (FlashAttention's convention). Q and O always; K and V
  too unless paged.
* ``paged_kv``: K and V are pages viewed as (pages, heads, page_size, head_dim); key ``j`` of
  sequence ``b`` is row ``j % page_size`` of page ``block_table[b, j // page_size]`` and the
  sequence has ``seqlens_k[b]`` keys (vLLM's convention). With the page size compiled in
  (``spec.page_size``) a key block is copied a page at a time (``copies.load_paged``: one table
  read per page); otherwise each row is gathered on its own (``copies.load_gathered``).

Trace-time Python: the lengths and offsets it returns are run-time values read from the tables.
Whatever the tables hold, they stay inside the tensors: each offset is clamped into its packed
tensor's rows (so a sequence's rows are too, and wrapped or decreasing offsets give an empty
sequence), a paged sequence's keys into its block-table row's pages, each page index into the
cache. A wrong table then gives wrong numbers, never an access outside q, k, v, out or the LSE.
"""


import cutlass
import cutlass.cute as cute


def _clamped(value, lo, hi):
    return cutlass.min(cutlass.max(value, lo), hi)


def cache_page(block_table: cute.Tensor, pages, batch, index):
    """The cache page of sequence ``batch``'s ``index``-th page, inside a cache of ``pages``:
    one unsigned minimum (a negative entry is a large unsigned one)."""
    page = cutlass.Uint32(block_table[batch, index])
    return cutlass.Int32(cutlass.min(page, cutlass.Uint32(pages - 1)))


class Sequences:
    """The serving tables of one kernel (None where the spec does not use them)."""

    def __init__(self, spec, serving):
        """``serving``: the kernel's serving tables (``flashcore.specs.params.ATTENTION``)."""
        self.varlen, self.paged = spec.varlen, spec.paged_kv
        self.cu_q, self.cu_k = serving.cu_seqlens_q, serving.cu_seqlens_k
        self.block_table, self.seqlens_k = serving.block_table, serving.seqlens_k
        # a packed sequence's first row and row count in Q (and K), read once
        self.q_span = self.k_span = None

    @staticmethod
    def _span(cu: cute.Tensor, batch, total):
        """(first row, rows) of sequence ``batch`` of offsets ``cu``, inside 0..total."""
        start = _clamped(cu[batch], 0, total)
        return start, _clamped(cu[batch + 1], start, total) - start

    def query_len(self, mQ: cute.Tensor, batch):
        """How many query rows sequence ``batch`` has."""
        if self.varlen:
            if self.q_span is None:
                self.q_span = self._span(self.cu_q, batch, mQ.shape[2])
            return self.q_span[1]
        return mQ.shape[2]

    def packed_keys(self, total, batch):
        """(first row, rows) of packed sequence ``batch``'s keys among ``total`` (a kernel that
        sees K only through a TMA view of its rows)."""
        if self.k_span is None:
            self.k_span = self._span(self.cu_k, batch, total)
        return self.k_span

    def key_len(self, mK: cute.Tensor, batch):
        """How many keys sequence ``batch`` has (for a paged cache, at most its block-table
        row's pages hold)."""
        if self.paged:
            return self.paged_key_len(batch, mK.shape[2])
        if self.varlen:
            if self.k_span is None:
                self.k_span = self._span(self.cu_k, batch, mK.shape[2])
            return self.k_span[1]
        return mK.shape[2]

    def query_rows(self, t: cute.Tensor, batch, head):
        """The rows of (batch, head) of Q-shaped ``t`` (Q, O, or the LSE) as a (seq, ...)
        tensor."""
        if cute.rank(t) == 4:
            rows, origin = t[0 if self.varlen else batch, head, None, None], (0, 0)
        else:
            rows, origin = t[0 if self.varlen else batch, head, None], (0,)
        if self.varlen:
            if self.q_span is None:
                self.q_span = self._span(self.cu_q, batch, t.shape[2])
            return cute.domain_offset((self.q_span[0], *origin[1:]), rows)
        return rows

    def key_rows(self, t: cute.Tensor, batch, kv_head):
        """The rows of (batch, kv_head) of K-shaped ``t`` as a (seq, head_dim) tensor (not for
        a paged cache: see ``paged_slot`` and ``page``)."""
        if self.varlen:
            if self.k_span is None:
                self.k_span = self._span(self.cu_k, batch, t.shape[2])
            return cute.domain_offset((self.k_span[0], 0), t[0, kv_head, None, None])
        return t[batch, kv_head, None, None]

    def paged_key_len(self, batch, page_size):
        """How many keys paged sequence ``batch`` has: at most its block-table row's pages
        hold."""
        return _clamped(self.seqlens_k[batch], 0, self.block_table.shape[1] * page_size)

    def _page_index(self, t: cute.Tensor, batch, index):
        return cache_page(self.block_table, t.shape[0], batch, index)

    def paged_slot(self, t: cute.Tensor, batch, key):
        """Where key ``key`` of sequence ``batch`` sits in paged ``t``: (cache page, row of the
        page). The page size is a run-time value here, so this costs a division."""
        page_size = t.shape[2]
        return self._page_index(t, batch, key // page_size), key % page_size

    def page(self, t: cute.Tensor, batch, kv_head, index):
        """Page ``index`` of (batch, kv_head)'s keys in paged ``t``: its (page_size, head_dim)
        rows, or for a (pages, heads, page_size) tensor of per-key descales its (page_size,)
        values."""
        page = self._page_index(t, batch, index)
        if cute.rank(t) == 3:
            return t[page, kv_head, None]
        return t[page, kv_head, None, None]
