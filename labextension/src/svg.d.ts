// SVG files are bundled as strings by the JupyterLab builder (asset/source).
declare module '*.svg' {
  const value: string;
  export default value;
}
