"""How a component is built: from its config (`components`: a network, a callable, an optimizer, an instance of a
base class by its spelling or `_target_`), and checked on a batch before the first step (`checks`). A whole run is
built by `multiloss.training`."""
