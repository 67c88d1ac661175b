"""The examples: a package, so that tests and benchmarks import them (`from examples.models import
GPT`) from the checkout's root without editing sys.path. The scripts (train.py, lightning_fit.py,
hf_trainer.py, titan_flow.py) also run as files, from any directory."""
