"""What fidelity is measured with, by the product (`calibrate`, learning a wrapper) and by the
benchmarks alike: intervals (`stats`), scoring an answer and the confidence rule (`answers`),
the generated question suite (`suite`), cloze questions over a store's own text (`cloze`) and
the machine a figure was measured on (`machine`). It imports nothing above the store's text;
`sparsecache.bench` consumes it, never the other way round."""
