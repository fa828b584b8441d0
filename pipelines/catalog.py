"""The names a run's options choose from, in one light module (no torch, Ray or MLflow): the
command line builds its help from them, and the modules that implement each name import its
list from here."""

from __future__ import annotations

# dataset name -> (torchvision's folder name, the standard install path, the Debian package)
IDX_DATASETS = {
    "fashion-mnist": ("FashionMNIST", "/usr/share/datasets/fashion-mnist", "dataset-fashion-mnist"),
    "mnist": ("MNIST", "/usr/share/datasets/mnist", None),
}
TEXT_DATASETS = ("spamassassin", "text")  # tokenized at ingest by the model's (hf:) tokenizer
EMAIL_VIEWS = ("message", "subject-body")  # what of an e-mail is tokenized
DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "imagefolder", "generated", *TEXT_DATASETS)
NEEDS_DATA_DIR = ("cifar10", "cifar100", "imagefolder", *TEXT_DATASETS)  # mnist and fashion-mnist have a standard path
USES_DATA_DIR = NEEDS_DATA_DIR + tuple(IDX_DATASETS)

MODELS = (
    "mlp", "small_cnn", "cnn", "resnet9", "wrn16_4", "scatter_linear", "scatter_cnn", "tv:<torchvision name>",
    "hf:<folder or hub name>",
)  # fmt: skip

CLIENT_SPLITS = ("noniid", "iid")  # how DP-FedAvg divides the training data among the clients

AUDIT_MECHANISMS = ("dpsgd", "bam", "dpadam-laplace", "fedavg", "pca")  # dp-platform audit --mechanism
