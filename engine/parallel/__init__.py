"""DP × PCP × PP (× TP) execution: the rank grid, the PCP token split, KV placement, rank processes."""
