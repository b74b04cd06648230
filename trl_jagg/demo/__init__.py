"""The CPU demo: the shipped tiny pipeline (``assets/demo_flux``), its training run (``run``) and the script that
pretrained it (``pretrain``)."""
