"""The vision tower on a layout of its own: which ranks run it with which TP / DP, checked before
launch (``layout``), and, with ``--vision-nproc``, the process groups, megatron's
``parallel_state`` globals and the hooks megatron.training needs to run it on ranks of its own
(``groups``)."""
