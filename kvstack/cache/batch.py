"""A decode step's batch: the running sequences, each at its own position, one new token
each, over the block pools they share.

Built once per step, on the device, it is the step's plan -- `positions` [B], `slots` [B]
(window-ring and partial-group rows), `block_table` [B, max_blocks] (padded with the null
block), `stream_lens` per stream layer [B] (entries after this step's token) -- and the
torch backend that reads and writes the packed pools through it: every call is a gather or
a scatter over the whole batch, with no loop over sequences and nothing read back to the
host (nor are the values looked at as they are packed: the runner checks the step's
logits instead). Which sequences complete a group at a source is known from the positions alone
((p + 1) % ratio == 0), so the rows a step does not keep are written to the null block
instead of being branched around; rows a sequence does not hold read from there too.
"""

import torch

from kvstack import native
from kvstack.cache.paged import PagedSequenceStore
from kvstack.cache.rows import PackedRows
from kvstack.cache.store import KVStore
from kvstack.formats import dequantize, unpack_rows

# Index keys dequantised at once by `score_index_keys`, over the whole batch (2 MiB of
# float32): they are then still in a CPU's cache when the matmul reads them, where 4,096
# keys of 32 sequences (32 MiB) would go out to memory and back. On the bench model's
# shapes (32 sequences of 512 or 1,024 entries, 1 or 8 of 1,024 to 16,384) 1 MiB chunks
# scored 10-20 % slower, in twice the ops, and 4 MiB ones up to 3.7x slower (16,384 keys
# of one sequence).
KEY_FLOATS = 1 << 19


class DecodeBatch(KVStore):
    def __init__(self, stores: list[PagedSequenceStore], kernels: bool = False,
                 rows: int | None = None, counts: list[int] | None = None) -> None:
        """kernels: attention and index scores by the Triton kernels (`attend`,
        `index_scores`); without them, on a CPU step that runs the C kernels
        (`kvstack.native`), attention is `attend` by those. rows: the batch padded to this
        many rows (a compiled step's batch-size bucket, so that one graph serves every
        batch up to it). A pad row is a sequence at position 0 with no blocks: it reads
        and writes the rings' pad slot, its stream entries go to the null block, and its
        logits are the caller's to drop.

        counts: how many new tokens each sequence takes (default one: a decode step); a
        sequence's tokens are consecutive rows at consecutive positions (DSpark's verify).
        Such a batch runs on the C kernels alone, which take a row's writes and reads in
        row order, so each row sees its sequence's earlier rows as a sequential step
        would; the torch paths of the rings and partial groups refuse it."""
        if not stores:
            raise ValueError("a decode batch needs at least one sequence")
        counts = [1] * len(stores) if counts is None else list(counts)
        if len(counts) != len(stores) or min(counts) < 1:
            raise ValueError(f"counts: one positive count per sequence, got {counts} for "
                             f"{len(stores)} sequences")
        self.counts = counts
        self.several = max(counts) > 1  # some sequence takes several rows
        pools = stores[0].pools
        if any(s.pools is not pools for s in stores):
            raise ValueError("a decode batch joins sequences of one cache")
        if len({s.slot for s in stores}) != len(stores):
            raise ValueError("a decode batch holds each sequence once")
        for s in stores:
            if not s.caught_up:
                raise ValueError("a decode batch starts from stores whose streams, partial "
                                 "groups and window rings hold every token (replay first)")
        for s, n in zip(stores, counts, strict=True):
            s.check_room(n)
        if self.several and (kernels or rows is not None):
            raise ValueError("a decode batch with several tokens of a sequence runs the C "
                             "kernels, unpadded")
        rows = sum(counts) if rows is None else rows
        pad = rows - sum(counts)
        if pad < 0:
            raise ValueError(f"a decode batch of {len(stores)} sequences cannot be padded to "
                             f"{rows} rows")
        if pad and stores[0].rings.pad_slot is None:
            raise ValueError("a padded decode batch needs a cache with a pad slot "
                             "(PagedCache(pad_slot=True))")
        super().__init__(stores[0].config, rows, pools.device)
        self.stores, self.pools = stores, pools
        self.rings, self.partials = stores[0].rings, stores[0].partials
        self.triton = kernels
        self.c_attention = not kernels and native.enabled() and pools.device.type == "cpu"
        if self.several and not self.c_attention:
            raise ValueError("a decode batch with several tokens of a sequence runs the C "
                             "kernels (kvstack.native), which are off for this step")
        dev, null = self.device, pools.null_block
        # Row by row (a sequence's rows together, in order), then the pad rows.
        held = [s for s, n in zip(stores, counts, strict=True) for _ in range(n)]
        lengths = [s.num_tokens + j for s, n in zip(stores, counts, strict=True)
                   for j in range(n)] + [0] * pad  # the new tokens' positions
        width = max(len(s.block_table) for s in stores)
        tables = [s.block_table for s in held] + [[]] * pad
        self.row_positions = lengths  # the host's copy
        padded = [t + [null] * (width - len(t)) for t in tables]
        self.block_table = torch.tensor(padded, device=dev)  # [B, max_blocks]
        # Per stream ratio, made on the host (a few ints a sequence, where torch would
        # dispatch a dozen ops a ratio): each sequence's entries with this step's token
        # [B], and where the entry its token ends goes: its row for the sequences whose
        # token completes a group, row 0 of the null block for the rest (block [B],
        # offset [B]). Layers of one ratio share them. One tensor holds these rows with
        # the positions and ring slots (a tensor made from host ints costs several
        # microseconds whatever its size).
        ratios = sorted(set(pools.ratios.values()))
        host = [lengths, [s.slot for s in held] + [self.rings.pad_slot] * pad]
        for r in ratios:
            per = pools.block_tokens // r
            counts = [(p + 1) // r for p in lengths]
            complete = [(p + 1) % r == 0 for p in lengths]
            host.append(counts)
            host.append([row[(c - 1) // per] if done else null
                         for row, c, done in zip(padded, counts, complete, strict=True)])
            host.append([(c - 1) % per if done else 0
                         for c, done in zip(counts, complete, strict=True)])
        self.positions, self.slots, *per_ratio = torch.tensor(host, device=dev).unbind()  # [B]
        lens = {r: per_ratio[3 * i] for i, r in enumerate(ratios)}
        new_rows = {r: (per_ratio[3 * i + 1], per_ratio[3 * i + 2]) for i, r in enumerate(ratios)}
        self.stream_lens = {layer: lens[r]  # [B], this step's entry included
                            for layer, r in pools.ratios.items()}
        self._new_rows = {layer: new_rows[r] for layer, r in pools.ratios.items()}
        # The ids before each new token that Engram hashes, made when the tokens come
        # (`append_tokens`; host copies, so the step itself builds nothing from host lists).
        self._history: torch.Tensor | None = None
    def mark_dynamic(self) -> None:
        """For a traced step (Model.compile_decode): the table's width is symbolic, so
        that a growing context runs the same graph; the batch size is not (a padded
        batch's bucket names its graph). (Not done for an eager step: it would load
        torch's compiler.)"""
        torch._dynamo.maybe_mark_dynamic(self.block_table, 1)

    # ---- tokens ----------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """The most tokens a sequence holds before this step's last row of it."""
        return max(s.num_tokens + n - 1 for s, n in zip(self.stores, self.counts, strict=True))

    def start_positions(self) -> torch.Tensor:
        return self.positions

    def token_ids(self) -> torch.Tensor:
        raise ValueError("the sequences of a decode batch have different lengths: read "
                         "each store")

    def append_tokens(self, ids: torch.Tensor | list[list[int]]) -> None:
        rows = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        if len(rows) != self.batch_size or any(len(r) != 1 for r in rows):
            raise ValueError(f"a decode batch takes one token for each of its "
                             f"{self.batch_size} rows")
        count = self.config.engram_max_ngram_size - 1 if self.config.engram_layer_ids else 0
        history, row = [], 0
        # A padded batch's pad rows advance nothing.
        for store, n in zip(self.stores, self.counts, strict=True):
            for _ in range(n):
                ids = store.held_ids
                history.append([0] * max(0, count - len(ids)) + ids[max(0, len(ids) - count):]
                               if count else [])
                store.advance(rows[row][0])
                row += 1
        history += [[0] * count] * (self.batch_size - row)
        self._history = torch.tensor(history, dtype=torch.long, device=self.device)

    def recent_ids(self, start: torch.Tensor, count: int) -> torch.Tensor:
        """Taken from the host's copy of each sequence's ids when its tokens came."""
        if self._history is None:
            raise ValueError("a decode batch hands out the ids before its tokens once it "
                             "has them (append_tokens)")
        if count != self._history.shape[1]:
            raise ValueError(f"a decode batch holds the {self._history.shape[1]} ids before "
                             f"each new token (what Engram hashes), not {count}")
        return self._history

    # ---- window rings ------------------------------------------------------------------
    def _one_row_each(self, what: str) -> None:
        if self.several:
            raise ValueError(f"{what} by torch takes one row a sequence; a batch with several "
                             "tokens of a sequence runs it in the C kernels")

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._one_row_each("a ring read")
        return self.rings.read_at(layer, self.slots, self.positions)

    def write_window(self, layer: int, entries: torch.Tensor,
                     start: int | torch.Tensor) -> torch.Tensor:
        self._one_row_each("a ring write")
        return self.rings.write_at(layer, self.slots, entries, self.positions)

    def attend_window(self, layer: int, entries: torch.Tensor,
                      start: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new entries written, then the ring read from the row after each: the last
        window_size positions, the new one last ([B, window, D], [B, window]). Read
        before the write instead, a traced step copies each ring whole twice (Inductor
        cannot write into a tensor a pending read still needs): 4.5 MB and 3.7 ms of a
        batch-32 step on the decode benchmark's model."""
        self._one_row_each("a ring write and read")
        self.rings.write_at(layer, self.slots, entries, self.positions)
        return self.rings.read_at(layer, self.slots, self.positions + 1)

    # ---- streams -----------------------------------------------------------------------
    def stream_len(self, layer: int) -> int:
        """Entries the block table reaches, at least the longest sequence's after this
        step's token (each sequence's own count is `stream_lens[layer]`; reads past it
        come back from the null block, and attention masks them by position). A function
        of the table's width, so a traced step's shapes follow it, not each group."""
        return self.block_table.shape[1] * (self.pools.block_tokens // self.pools.ratios[layer])

    def append_stream(
        self, layer: int, entries: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Entries [B, 1, width] of the group each sequence's token ends; kept only where
        it completes one."""
        block, offset = self._new_rows[layer]
        stored = {}
        for kind, x in entries.items():
            pool = self.pools.rows[layer, kind]
            if native.fuses(x) and native.decodes(pool.fmt):  # one C call, in place
                stored[kind] = native.stream_write(x[:, 0], pool.fmt, pool.data, block,
                                                   offset)[:, None]
                continue
            rows, values = pool.pack(x[:, 0], check=False)
            pool.data[block, offset] = rows
            stored[kind] = values[:, None]
        return stored

    def _row_index(self, layer: int, kind: str, entries: torch.Tensor) -> torch.Tensor:
        """Where entries [B, ...] of each sequence lie in the pool's rows, counted over
        its blocks' entries as one (the null block's first row where a sequence holds no
        such entry)."""
        per = self.pools.entries_per_block[layer, kind]
        b = entries.shape[0]
        held = entries < self.stream_lens[layer].view(b, *(1,) * (entries.dim() - 1))
        block = self.block_table.gather(1, (entries // per).reshape(b, -1)).view_as(entries)
        return torch.where(held, block * per + entries % per, self.pools.null_block * per)

    def read_stream(self, layer: int, kind: str, start: int, stop: int) -> torch.Tensor:
        pool = self.pools.rows[layer, kind]
        return pool.read(stream_rows(pool.data, self.block_table, self.stream_lens[layer],
                                     start, stop))

    def gather_stream(self, layer: int, kind: str, entries: torch.Tensor) -> torch.Tensor:
        # Only the selected rows are read and dequantised.
        return self.pools.rows[layer, kind].read_at(self._row_index(layer, kind, entries))

    # ---- partial groups ----------------------------------------------------------------
    def partial(self, source: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._one_row_each("a partial group's read")
        return self.partials.values[source][self.slots], self.partials.gates[source][self.slots]

    def set_partial(self, source: int, values: torch.Tensor, gate_logits: torch.Tensor) -> None:
        """Record the new token's values [B, 1, D] at each sequence's fill; a sequence
        whose group it completes starts empty, so where it lands does not matter."""
        self._one_row_each("a partial group's write")
        r = self.pools.ratios[source]
        fill = (self.positions % r).clamp(max=r - 2)
        self.partials.values[source][self.slots, fill] = values[:, 0].detach().float()
        self.partials.gates[source][self.slots, fill] = gate_logits[:, 0].detach().float()

    def stream_writes(self, layer: int) -> tuple[torch.Tensor, str, torch.Tensor, str,
                                                 torch.Tensor, torch.Tensor] | None:
        """What a C compressor step takes to write this step's entries of a kv source
        itself (`native.compress_step`'s `write`: the "kv" and "index" pools and formats,
        where the new rows go), where the C kernels write both formats; else None."""
        kv, index = self.pools.rows[layer, "kv"], self.pools.rows[layer, "index"]
        if not (self.c_attention and native.decodes(kv.fmt) and native.decodes(index.fmt)):
            return None
        return (kv.data, kv.fmt, index.data, index.fmt, *self.new_rows(layer))

    def new_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the entries this step's tokens end in layer's stream go (`stream_writes`'
        last two): blocks [B] and offsets [B], row 0 of the null block for a sequence whose
        token completes no group."""
        return self._new_rows[layer]

    def partial_groups(self, source: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a C compressor step updates in place: source's partial values and gate
        logits of every slot [n_slots, ratio - 1, D], and this batch's slots [B]."""
        return self.partials.values[source], self.partials.gates[source], self.slots

    def group_rows(self, source: int) -> torch.Tensor | None:
        """Where a C compressor step hands each row's new values and gate logits [B, 2,
        D] (`native.compress_step`'s group_rows), for the sequences that may take tokens
        back (`PagedSequenceStore.speculate`); None when none may."""
        if not self.speculates():
            return None
        return torch.empty(self.batch_size, 2, self.partials.values[source].shape[-1])

    def speculates(self) -> bool:
        """Whether a sequence of the batch may take tokens back (its store keeps what
        rebuilding its partial groups needs)."""
        return any(s.speculation is not None for s in self.stores)

    def saw_rows(self, source: int, rows: torch.Tensor) -> None:
        """Hand what `group_rows` got to the sequences that keep it."""
        row = 0
        for store, n in zip(self.stores, self.counts, strict=True):
            if store.speculation is not None:
                store.saw_group_rows(source, rows[None, row : row + n, 0],
                                     rows[None, row : row + n, 1], self.row_positions[row])
            row += n

    def drop_window_state(self) -> None:
        raise ValueError("a decode batch does not replay: rebuild each store first")

    # ---- the step's own scoring and attention ------------------------------------------
    # A decode batch scores index keys itself, by the Triton kernel with `kernels`, else
    # by torch (`score_index_keys`).
    scores_index_keys = True

    def index_scores(self, source: int, q: torch.Tensor, w: torch.Tensor,
                     n_entries: int) -> torch.Tensor:
        """The indexer's scores of queries q [B, 1, Hi, Di] with head weights w [B, 1, Hi]
        over the first n_entries of source's index stream, entries not yet visible -inf:
        [B, 1, n_entries]."""
        rows = self.pools.rows[source, "index"]
        args = (q[:, 0], w[:, 0], rows.data, self.block_table, self.positions, n_entries,
                self.pools.ratios[source])
        if self.triton:
            from kvstack.cache.kernels import index_scores

            return index_scores(*args)[:, None]
        return score_index_keys(*args, rows.fmt, rows.width)[:, None]

    def scores_entries(self, source: int) -> bool:
        """Whether `index_scores_at` scores source's index keys: the C kernel, where it
        decodes the stream's format."""
        return (self.c_attention and not torch.compiler.is_compiling()
                and native.decodes(self.pools.rows[source, "index"].fmt))

    def index_scores_at(self, source: int, q: torch.Tensor, w: torch.Tensor,
                        entries: torch.Tensor) -> torch.Tensor:
        """Where `scores_entries(source)`: the indexer's scores of queries q [B, 1, Hi,
        Di] with head weights w [B, 1, Hi] at each sequence's own entries [B, 1, K] of
        source's index stream, read where they lie, -inf past its count: [B, 1, K]."""
        rows = self.pools.rows[source, "index"]
        return native.index_scores_at(q[:, 0], w[:, 0], rows.data, self.block_table,
                                      self.stream_lens[source], entries[:, 0],
                                      rows.fmt)[:, None]

    def select_in_pool(self, source: int, q: torch.Tensor, w: torch.Tensor,
                       spans: torch.Tensor, span: int, k: int) -> torch.Tensor:
        """Where `scores_entries(source)`: the best k entries of each sequence's candidate
        pool (spans [B, 1, kb] of `span` entries) by the indexer's scores of queries q [B,
        1, Hi, Di] with head weights w [B, 1, Hi] over source's index keys, in one C call
        (`native.select_in_pool`): [B, 1, min(k, kb * span)], -1 for none."""
        rows = self.pools.rows[source, "index"]
        return native.select_in_pool(q[:, 0], w[:, 0], rows.data, rows.fmt, self.block_table,
                                     self.stream_lens[source], spans[:, 0], span, k)[:, None]

    def attends(self) -> bool:
        """Whether `attend` runs this step's attention: the Triton kernel, or the C one;
        never inside a traced step, whose graph holds the model's own math."""
        return self.triton or (self.c_attention and not torch.compiler.is_compiling())

    def attends_dense(self) -> bool:
        """Whether `attend_dense` runs a dense layer's attention: the C kernel."""
        return self.c_attention and not torch.compiler.is_compiling()

    def dense_stream(self, layer: int) -> tuple[PackedRows, PackedRows,
                                                tuple[torch.Tensor, torch.Tensor],
                                                torch.Tensor]:
        """Where `attends_dense()`, what a C step that writes this step's rows of a dense
        layer and attends over them in one call takes beside `block_table`: the "k" and
        "v" pools, where the new rows go (block [B], offset [B]) and each sequence's
        entries with them [B]."""
        return (self.pools.rows[layer, "k"], self.pools.rows[layer, "v"],
                self._new_rows[layer], self.stream_lens[layer])

    def attend_dense(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Where `attends_dense()`: q [B, 1, H, D] over every entry of the dense layer's
        "k" and "v" streams up to each sequence's own (this step's written), causal GQA:
        [B, 1, H, D]."""
        keys, values = self.pools.rows[layer, "k"], self.pools.rows[layer, "v"]
        out = native.dense_attention(q[:, 0], keys.data, values.data, keys.fmt, keys.width,
                                     self.block_table, self.stream_lens[layer])
        return out[:, None].type_as(q)

    def attend(self, layer: int, source: int | None, q: torch.Tensor,
               selected: torch.Tensor | None, sink: torch.Tensor,
               window: torch.Tensor | None = None, keep: dict | None = None) -> torch.Tensor:
        """Where `attends()`: q [B, 1, H, D] over the layer's window ring (the new entry
        written) and the selected entries of source's stream ([B, 1, k], -1 for none;
        None for none at all), with the sink: [B, 1, H, D]. window: this step's window
        entries [B, 1, D], written first as `write_window` writes them (on a CPU, in the
        attention's own C call), where the caller has not written them. keep: the
        caller's kept plans for the C call (`native.sparse_attention`'s)."""
        ring = self.rings.rows[layer]
        if not self.triton:
            in_call = window is not None and native.fuses(window) and native.decodes(ring.fmt)
            if window is not None and not in_call:
                self.write_window(layer, window, self.positions)
            pool = None if selected is None or source is None else self.pools.rows[source, "kv"]
            return native.sparse_attention(
                q, sink, ring.data, ring.fmt, self.rings.pos[layer], self.slots,
                self.positions, None if pool is None else pool.data,
                None if pool is None else pool.fmt, self.block_table,
                None if pool is None else selected, self.config.window_size,
                window if in_call else None, keep).type_as(q)
        from kvstack.cache.kernels import sparse_attention

        if window is not None:
            self.write_window(layer, window, self.positions)
        if selected is None or source is None:
            pool = ring
            chosen = torch.full((self.batch_size, 0), -1, dtype=torch.long, device=self.device)
        else:
            pool, chosen = self.pools.rows[source, "kv"], selected[:, 0]
        out = sparse_attention(q[:, 0], sink, ring.data, self.rings.pos[layer], self.slots,
                               self.positions, pool.data, self.block_table, chosen,
                               self.config.window_size)
        return out[:, None].type_as(q)


def stream_rows(pool: torch.Tensor, block_table: torch.Tensor, held: torch.Tensor,
                start: int, stop: int) -> torch.Tensor:
    """Packed rows start..stop-1 of each sequence's stream, [B, stop - start, bytes], from
    pool [blocks, entries per block, bytes] through block_table [B, max_blocks]. Rows at
    or past a sequence's own count (held [B]) read as the null block's zeros."""
    rows = _table_rows(pool, block_table, start, stop)
    inside = torch.arange(start, stop, device=pool.device) < held[:, None]
    return rows * inside[..., None]  # (a product: where() is 7x slower on a CPU)


def _table_rows(pool: torch.Tensor, block_table: torch.Tensor, start: int,
                stop: int) -> torch.Tensor:
    """Packed rows start..stop-1 through the table as they are, [B, stop - start, bytes]:
    whole blocks, one copy each rather than an index per entry."""
    per = pool.shape[1]
    first, end = start // per, -(-stop // per)
    rows = pool.index_select(0, block_table[:, first:end].flatten()).view(
        block_table.shape[0], -1, pool.shape[-1])  # [B, whole blocks' entries, bytes]
    if start == first * per and stop == end * per:
        return rows
    return rows[:, start - first * per : stop - first * per]


def score_index_keys(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor,
                     block_table: torch.Tensor, positions: torch.Tensor, n_entries: int,
                     ratio: int, fmt: str, width: int) -> torch.Tensor:
    """score(j) = sum_h w_h relu(q_h . k_j) of each sequence's query (q [B, Hi, Di], w
    [B, Hi], at positions [B]) over entries 0..n_entries-1 of a ratio-`ratio` stream of
    index keys in format fmt, entries not yet visible -inf: [B, n_entries]. The keys are
    read and dequantised a chunk of KEY_FLOATS at a time and multiplied keys first, or,
    where the C kernels are on (`kvstack.native`), scored from the packed bytes.

    One opaque op to a traced step: torch.compile's own code for these gathers and
    lookups runs slower than torch's kernels on a CPU, and the chunk follows the batch
    size, which the graph keeps symbolic. (Eager calls it directly: a custom op's first
    call loads torch's compiler, ~150 MB and seconds.)"""
    args = (q, w, pool, block_table, positions, n_entries, ratio, fmt, width)
    return _score_index_keys_op(*args) if torch.compiler.is_compiling() else _scores(*args)


def _scores(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
            positions: torch.Tensor, n_entries: int, ratio: int, fmt: str,
            width: int) -> torch.Tensor:
    if native.enabled() and pool.device.type == "cpu" and native.decodes(fmt):
        return native.index_scores(q, w, pool, block_table, positions, n_entries, ratio, fmt)
    b, per = q.shape[0], pool.shape[1]
    held = (positions + 1) // ratio  # [B], this step's entry included
    chunk = max(per, KEY_FLOATS // (b * width) // per * per)  # whole blocks
    q_t, w_col = q.float().transpose(1, 2), w.float()[:, :, None]  # [B, Di, Hi], [B, Hi, 1]
    parts = []
    # Rows past a sequence's entries are scored as they are (whatever they hold, even
    # NaN scales) and masked after: an entry's score depends on its own key alone.
    for start in range(0, n_entries, chunk):
        rows = _table_rows(pool, block_table, start, min(start + chunk, n_entries))
        keys = dequantize(unpack_rows(rows, fmt, width))  # [B, K, Di]
        parts.append(torch.bmm(torch.bmm(keys, q_t).relu_(), w_col).view(b, -1))  # [B, K]
    if len(parts) == 1:
        scores = parts[0]
    else:
        scores = torch.cat(parts, dim=1) if parts else q.new_zeros(b, 0, dtype=torch.float32)
    visible = torch.arange(n_entries, device=q.device) < held[:, None]
    return scores.masked_fill_(~visible, float("-inf"))


@torch.library.custom_op("kvstack::score_index_keys", mutates_args=())
def _score_index_keys_op(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor,
                         block_table: torch.Tensor, positions: torch.Tensor, n_entries: int,
                         ratio: int, fmt: str, width: int) -> torch.Tensor:
    return _scores(q, w, pool, block_table, positions, n_entries, ratio, fmt, width)


@_score_index_keys_op.register_fake
def _(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
      positions: torch.Tensor, n_entries: int, ratio: int, fmt: str,
      width: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], n_entries, dtype=torch.float32)
