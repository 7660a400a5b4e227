"""``python -m hybrid.train``: the Hydra training app (:mod:`hybrid.app.train`)."""

from hybrid.app.train import main

if __name__ == "__main__":
    main()
