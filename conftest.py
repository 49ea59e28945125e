pytest_plugins = ["tests.fixtures.fake_nvml", "tests.fixtures.federation", "tests.fixtures.lm"]
