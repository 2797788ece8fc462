"""The corpus ``pced index`` reads: which shape a file holds, chosen by its content (``formats``:
pced's own records, LOFT, HotpotQA, MuSiQue, NQ), and reading it with line-numbered validation and
chunking of long documents (``reader``)."""
