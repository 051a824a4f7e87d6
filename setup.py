"""rpycdl: run Python functions on shared GPU servers over RPyC."""

from setuptools import find_packages, setup

CLIENT = [
    "rpyc>=6.0,<6.1",  # rpycdl overrides private methods of rpyc 6.0: tests/unit/test_rpyc_internals.py
    "dill>=0.3.8",
    "pathspec>=0.11",  # a working directory's .rpycdlignore (gitignore syntax)
    "tqdm>=4.60",  # download progress
    "blake3>=0.4",  # the content hash that names working directories (rpycdl.artifacts.workdir)
    "tomli>=1.1; python_version < '3.11'",
]
"""`pip install rpycdl`: the client (rpycdl.connect and everything it imports)."""

SERVER = ["fasteners>=0.19", "nvidia-ml-py>=12.535", "prometheus-client>=0.20", "starlette>=0.37", "uvicorn>=0.47",
          "fsspec>=2023.6", "s3fs>=2023.6"]
"""`rpycdl[server]`: `rpycdl serve` (GPU locks, NVML), `rpycdl monitor` (metrics and dashboard over HTTP) and the
demo, the artifact store (a local directory, or S3 and MinIO through fsspec and s3fs)."""

SITE = ["docker>=7.0", "cryptography>=41"]
"""`rpycdl[site]`: `rpycdl up`/`down`, job containers of the generic server, `rpycdl certs`."""

setup(
    name="rpycdl",
    version="0.1.0",
    description="Run Python functions on shared GPU servers over RPyC, first come, first served",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["rpycdl", "rpycdl.*"]),
    package_data={"rpycdl": ["py.typed"], "rpycdl.monitor": ["static/*"]},  # the monitor's dashboard
    python_requires=">=3.10",
    install_requires=CLIENT,
    extras_require={
        "server": SERVER,
        "site": SITE,
        "all": SERVER + SITE,
        "test": SERVER + SITE + ["pytest>=8", "hypothesis>=6", "ruff>=0.5", "numpy>=1.22", "selenium>=4",
                                   "moto[server]>=5", "kubernetes-validate>=1.33",
                                   # the docs site (docs/, mkdocs.yml), built by tests/test_docs.py
                                   "mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26",
                                   # mkdocstrings 1.0.6, the last for Python 3.10, does not give pymdown-extensions
                                   # 12.2's highlighter the `md` it requires (1.0.8 does)
                                   "pymdown-extensions<12.2; python_version < '3.11'",
                                   # tests/test_notebook.py: a real Jupyter kernel, driven as Jupyter drives one
                                   "nbclient>=0.9", "nbformat>=5.9", "ipykernel>=6.25", "ipywidgets>=8"],
        "bench": ["ray>=2.9"],  # bench/bench_core.py compares with Ray where it is installed
    },
    entry_points={"console_scripts": ["rpycdl=rpycdl.cli:main"]},
    classifiers=["Programming Language :: Python :: 3", "Operating System :: POSIX :: Linux"],
)
