"""Plots and widget panels. These import plotly and ipywidgets themselves, so the core
package stays importable where only torch and triton exist (the GPU machine)."""
