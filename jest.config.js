/**
 * Jest runs the frontend's pure modules (formatting, sorting, the sidebar model) in node.
 * They import nothing from @jupyterlab/*, so no ESM transform of node_modules is needed;
 * @lumino/signaling ships a CommonJS (UMD) build.
 */
module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/labextension/src'],
  testMatch: ['**/__tests__/**/*.spec.ts'],
  transform: {
    '^.+\\.tsx?$': [
      'ts-jest',
      {
        tsconfig: {
          module: 'commonjs',
          target: 'ES2019',
          lib: ['ES2019', 'DOM'],
          strict: true,
          esModuleInterop: true,
          types: ['jest']
        }
      }
    ]
  }
};
