from mgpu_backend.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
