"""What a run reads: `corpus.py` (documents, the cached token stream, windows, samplers),
`tokenizer.py` (byte, BPE and Hugging Face tokenizers), `sft.py` (supervised records),
`genomics.py` (DNA tokens) and `fasta.py` (the FASTA reader)."""
