"""What two families or more build from: the decoder's layers and stack, the fused backward passes, the
chunked head and loss, and the MoE layer."""
